"""`edgeinfer serve`'s newer surfaces (Responses, Messages, tools, the model pool) against what a
hostile or sloppy client sends, each driven with the real clients or raw sockets: no 500, every
refusal in the API's own shape naming the field and the way out, and the connection still usable."""

import json
import signal
import socket

import anthropic
import httpx
import jsonschema
import openai
import pytest
from test_serve import start
from test_serve_tools import tool_export
from test_tools import HERMES

from edgeinfer import Engine

KEY = "surface-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, export) of a server of the tiny llama with a tool-calling chat template."""
    export = tool_export(tmp_path_factory.mktemp("serve-surfaces"), HERMES)
    store = ("--responses-store", "12", "--responses-store-mib", "1")
    process, url = start(export, "--provider", "cpu", "--max-batch", "2", "--api-key", KEY, *store)
    yield url, export
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(served):
    return Engine.load(served[1], provider="cpu")


def exchange(sock: socket.socket, path: str, body: dict) -> tuple[int, dict, dict]:
    """One request on a kept-alive socket: (status, headers, JSON body) of its response."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, json.loads(reader.read(int(headers["content-length"])))


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_a_template_variable_the_request_sets_is_a_400_naming_it_on_chat_and_responses(served, client, key):
    kwargs = {"extra_body": {"chat_template_kwargs": {key: 1}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served[1].name, messages=ASK, max_tokens=2, **kwargs)
    error = refused.value.body
    assert error["param"] == "chat_template_kwargs" and f"chat_template_kwargs.{key} is set from the request" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=served[1].name, input="Hi", max_output_tokens=2, **kwargs)
    assert refused.value.body["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("key", ["context", "self"])
def test_other_names_are_the_templates_own_variables_on_chat_and_responses(served, client, engine, key):
    kwargs = {key: "unused by this template"}
    chat = client.chat.completions.create(
        model=served[1].name, messages=ASK, max_tokens=6, extra_body={"chat_template_kwargs": kwargs}
    )
    assert chat.choices[0].message.content == engine.chat(ASK, max_new_tokens=6, chat_template_kwargs=kwargs).text
    reply = client.responses.create(
        model=served[1].name, input=ASK[0]["content"], max_output_tokens=6, extra_body={"chat_template_kwargs": kwargs}
    )
    assert reply.output_text == chat.choices[0].message.content


def test_after_a_refusal_or_a_500_the_kept_alive_connection_answers_the_next_request(served):
    with socket.create_connection(("127.0.0.1", int(served[0].rsplit(":", 1)[1])), timeout=60) as sock:
        refused = {"model": served[1].name, "messages": ASK, "chat_template_kwargs": {"messages": []}}
        for path, body in [("/v1/chat/completions", refused), ("/v1/nowhere", {}), ("/v1/messages", {"model": 1})]:
            status, headers, error = exchange(sock, path, body)
            assert 400 <= status < 500 and headers.get("connection") != "close", (path, status, error)
        status, _, chat = exchange(sock, "/v1/chat/completions", {"model": served[1].name, "messages": ASK, "max_tokens": 3})
        assert status == 200 and chat["usage"]["completion_tokens"] == 3


def test_an_exception_no_handler_takes_is_a_500_in_the_apis_shape_and_the_connection_stays(tmp_path):
    """The guard answers a bug itself: Starlette's outer handler would answer it, then re-raise it,
    and uvicorn then drops the kept-alive connection."""
    import threading

    import uvicorn
    from fastapi import FastAPI

    from edgeinfer.serve.guard import Guard
    from edgeinfer.serve.metrics import Metrics

    app = FastAPI()

    @app.post("/v1/messages")
    @app.post("/v1/chat/completions")
    async def failing():
        return {"half": 1 / 0}

    @app.post("/v1/completions")
    async def fine():
        return {"ok": True}

    app.add_middleware(Guard, metrics=Metrics(), routes=lambda: app.routes, api_key=KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            status, headers, body = exchange(sock, "/v1/chat/completions", {})
            assert status == 500 and body["error"]["type"] == "server_error" and "ZeroDivisionError" in body["error"]["message"]
            status, _, body = exchange(sock, "/v1/messages", {})
            assert status == 500 and body["type"] == "error" and body["error"]["type"] == "api_error"
            status, _, body = exchange(sock, "/v1/completions", {})
            assert (status, body) == (200, {"ok": True})
    finally:
        server.should_exit = True
        thread.join(10)


def test_tool_parameters_with_defs_are_served_on_all_three_apis(served, client):
    from test_tools import PYDANTIC_TOOL

    model, schema = served[1].name, PYDANTIC_TOOL["function"]["parameters"]
    chat = client.chat.completions.create(model=model, messages=ASK, tools=[PYDANTIC_TOOL], tool_choice="required", max_tokens=160)
    (call,) = chat.choices[0].message.tool_calls[:1]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    tool = {"type": "function", "name": "get_weather", "parameters": schema}
    reply = client.responses.create(model=model, input=ASK[0]["content"], tools=[tool], tool_choice="required", max_output_tokens=160)
    jsonschema.validate(json.loads(reply.output[0].arguments), schema)
    messages = anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0).messages.create(
        model=model, max_tokens=160, messages=ASK, tools=[{"name": "get_weather", "input_schema": schema}], tool_choice={"type": "any"}
    )
    jsonschema.validate(messages.content[-1].input, schema)


def stored(url: str) -> dict[str, float]:
    """The Responses store's gauges on /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {
        line.split()[0].removeprefix("edgeinfer_"): float(line.split()[1]) for line in lines if line.startswith("edgeinfer_responses_")
    }


def test_a_chain_of_responses_stores_each_turn_once_and_reads_back(served, client):
    model, filler, before = served[1].name, "word " * 50, stored(served[0])["responses_stored_bytes"]
    first = client.responses.create(model=model, input=f"Remember {filler}", max_output_tokens=4)
    one = stored(served[0])["responses_stored_bytes"] - before
    previous = first.id
    for turn in range(5):
        previous = client.responses.create(
            model=model, input=f"{turn} {filler}", previous_response_id=previous, max_output_tokens=4
        ).id
    after = stored(served[0])["responses_stored_bytes"] - before - one
    assert 4.5 * one < after < 5.5 * one  # five more turns' worth, not their whole histories
    again = client.responses.retrieve(previous)
    assert again.id == previous and again.previous_response_id is not None and again.status in ("completed", "incomplete")
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_the_store_keeps_its_count_drops_reasoning_items_and_deletes(served, client):
    model, before = served[1].name, stored(served[0])["responses_stored_bytes"]
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s" * 50_000}]}
    made = [
        client.responses.create(model=model, input=[{**thought, "encrypted_content": "e" * 300_000}, *ASK], max_output_tokens=2).id
    ]
    assert stored(served[0])["responses_stored_bytes"] - before < 5_000  # the 350 kB thought is not kept
    made += [client.responses.create(model=model, input=f"{i}", max_output_tokens=2).id for i in range(12)]  # the store keeps 12
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        client.responses.retrieve(made[0])
    assert stored(served[0])["responses_stored"] == 12 and client.responses.retrieve(made[-1]).id == made[-1]
    client.responses.delete(made[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[-1])
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=model, input="and then?", previous_response_id=made[-1], max_output_tokens=2)
    assert gone.value.body["param"] == "previous_response_id" and "send the whole conversation" in gone.value.body["message"]


def test_the_store_keeps_its_byte_bound_and_forgets_after_its_ttl():
    from edgeinfer.serve.responses import Store, StoreLimits

    now = [0.0]
    store = Store(StoreLimits(count=100, bytes=10_000, ttl=60), clock=lambda: now[0])
    for i in range(8):  # about 2 kB each: the last four fit
        store.keep(f"r{i}", None, [{"type": "message", "role": "user", "content": "x" * 2000}], {"id": f"r{i}"})
    assert store.bytes <= 10_000 and store.stats()["responses_stored"] == 4 and store.get("r7") == {"id": "r7"}
    store.keep("huge", None, [{"type": "message", "role": "user", "content": "x" * 20_000}], {"id": "huge"})
    assert store.stats()["responses_store_refused"] == 1 and store.stats()["responses_stored"] == 4  # nothing dropped for it
    now[0] = 50
    store.keep("next", "r7", [{"type": "message", "role": "user", "content": "b"}], {"id": "next"})
    now[0] = 100  # r7 unused for 100 s, next for 50 s
    with pytest.raises(Exception, match="lost its earlier response 'r7'"):
        store.history("next")
    assert store.get("next") == {"id": "next"} and store.stats()["responses_stored"] == 1
    now[0] = 200
    assert store.stats()["responses_stored"] == 0 and store.bytes == 0


def test_an_image_part_is_refused_by_a_text_only_model_on_every_api(served, client):
    model, way = served[1].name, "this model reads text only, and a message holds an image: send the image to a vision-language export"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError, match=way) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}])
    assert refused.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match=way):
        parts = [{"type": "input_text", "text": "What?"}, {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]
        client.responses.create(model=model, input=[{"type": "message", "role": "user", "content": parts}])
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match=way) as refused:
        anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0).messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": [block]}]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_a_last_assistant_message_is_continued_on_messages_and_chat(served, client, engine):
    """An assistant prefill: the reply continues the message (the prompt ends with its text,
    not with the template's end of turn and a new assistant turn)."""
    prefill = [ASK[0], {"role": "assistant", "content": '{"name": "'}]
    text, ids = engine.tokenizer.chat_prompt(prefill)
    assert text.endswith('<|im_start|>assistant\n{"name": "') and not text.endswith("<|im_start|>assistant\n")
    expected = engine.generate(ids, max_new_tokens=8)
    message = anthropic.Anthropic(base_url=served[0], api_key=KEY, max_retries=0).messages.create(
        model=served[1].name, max_tokens=8, messages=prefill
    )
    assert message.content[0].text == expected.text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(ids)  # Anthropic's input_tokens: the uncached
    chat = client.chat.completions.create(model=served[1].name, messages=prefill, max_tokens=8)
    assert chat.choices[0].message.content == expected.text and chat.usage.prompt_tokens == len(ids)
    assert engine.chat(prefill, max_new_tokens=8).text == expected.text


def test_chat_template_replaces_the_exports_own_in_serve_and_run(served, tmp_path):
    import subprocess
    import sys

    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    engine = Engine.load(served[1], provider="cpu", chat_template=template.read_text())
    assert engine.tokenizer.chat_prompt(ASK)[0] == "[user] What is the weather in Paris?\n[assistant]"
    process, url = start(served[1], "--provider", "cpu", "--chat-template", str(template))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(model=served[1].name, messages=ASK, max_tokens=6)
        assert chat.choices[0].message.content == engine.chat(ASK, max_new_tokens=6).text
        assert chat.usage.prompt_tokens == len(engine.tokenizer.chat_prompt(ASK)[1])
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }")
    command = [sys.executable, "-m", "edgeinfer.cli", "run", "--model", str(served[1]), "--provider", "cpu", "--chat"]
    done = subprocess.run([*command, "--chat-template", str(broken), "Hi"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the chat template does not parse (line 2)" in done.stderr and "Traceback" not in done.stderr
    several = [
        sys.executable,
        "-m",
        "edgeinfer.cli",
        "serve",
        "--model",
        str(served[1]),
        "--model",
        "x",
        "--chat-template",
        str(template),
    ]
    done = subprocess.run(several, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--chat-template applies to one model served without --ray" in done.stderr


def test_the_models_and_token_endpoints_clients_rely_on(served, client, engine):
    from test_tools import TOOLS

    url, model = served[0], served[1].name
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError, match="the model 'nope' is not served here"):
        client.models.retrieve("nope")

    chat = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=1)
    counted = httpx.post(f"{url}/tokenize", json={"messages": ASK, "tools": TOOLS}, headers=AUTH).json()
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens and counted["max_model_len"] == 2048
    text = "Edge boxes, €5"
    plain = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}, headers=AUTH).json()
    assert [t["id"] for t in plain["tokens"]] == engine.tokenizer.encode(text, False)
    assert "".join(t["piece"] for t in plain["tokens"] if isinstance(t["piece"], str)).startswith("Edge")
    back = httpx.post(f"{url}/detokenize", json={"tokens": engine.tokenizer.encode(text, False)}, headers=AUTH).json()
    assert back == {"content": text}
    refused = httpx.post(f"{url}/detokenize", json={"tokens": [1, 10**6]}, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    prompt = httpx.post(f"{url}/apply-template", json={"messages": ASK}, headers=AUTH).json()["prompt"]
    assert prompt == engine.tokenizer.chat_prompt(ASK)[0]
    props = httpx.get(f"{url}/props", headers=AUTH).json()
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] == 2
    assert props["chat_template"] == engine.tokenizer.chat_template and props["modalities"]["vision"] is False
    assert httpx.post(f"{url}/tokenize", json={"content": "x"}).status_code == 401  # the API key guards them as it guards /v1/

    reply = client.responses.create(model=model, input="Hi", instructions="Be brief.", max_output_tokens=2)
    counted = client.responses.input_tokens.count(model=model, input="Hi", instructions="Be brief.")
    assert counted.input_tokens == reply.usage.input_tokens
    follow = client.responses.input_tokens.count(model=model, input="And?", previous_response_id=reply.id)
    assert follow.input_tokens > counted.input_tokens

    lost = httpx.get(f"{url}/v1/nowhere", headers=AUTH).json()["error"]["message"]
    assert all(path in lost for path in ("/v1/responses", "/v1/messages", "/v1/embeddings", "/tokenize"))


def test_refusals_speak_each_apis_own_words(served, client):
    url, model = served
    model = model.name
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    long = [{"role": "user", "content": "w " * 3000}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=long, max_tokens=2)
    message = refused.value.body["message"]
    assert "truncate" not in message and "shorten the prompt (drop the oldest turns)" in message
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model, max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking.budget_tokens" in str(refused.value) and "reasoning_budget" not in str(refused.value)

    wrong_method = httpx.get(f"{url}/v1/messages", headers=AUTH)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=model, input="Hi", tools=[{"type": "function", "name": "f"}], tool_choice={"type": "file_search"}
        )
    assert refused.value.body["param"] == "tool_choice" and '{"type": "function", "name": NAME}' in refused.value.body["message"]

    unknown = "a tool result answers call 'call_x', which no earlier assistant message made"
    with pytest.raises(openai.BadRequestError, match=unknown):
        client.chat.completions.create(model=model, messages=[*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "20 C"}])
    with pytest.raises(openai.BadRequestError, match=unknown):
        client.responses.create(model=model, input=[{"type": "function_call_output", "call_id": "call_x", "output": "20 C"}])
    with pytest.raises(anthropic.BadRequestError, match=unknown):
        result = {"type": "tool_result", "tool_use_id": "call_x", "content": "20 C"}
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [result]}])

    for header, status in [(f"bearer {KEY}", 200), (f"BEARER  {KEY}", 200), ("Bearer wrong", 401), (f"Basic {KEY}", 401)]:
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": header}).status_code == status, header


def test_what_llama_cpps_suite_asks_of_templates(served, client, engine):
    """Found by running llama.cpp's server tests (tests/test_llama_suite.py): templates get its
    date variables and an assistant's reasoning_content, /apply-template takes
    add_generation_prompt and an empty tools list, and a template that raises is a 400."""
    import datetime

    from edgeinfer.sdk.errors import GenerationError

    shown = "{{ date_string }}|{{ datetime }}|{% for m in messages %}{{ m.reasoning_content or '' }}{% endfor %}"
    dated = Engine.load(served[1], provider="cpu", chat_template=shown)
    history = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "I thought."}, {"role": "user", "content": "And?"}]
    today = datetime.date.today()
    assert dated.tokenizer.chat_prompt(history)[0] == f"{today:%d %b %Y}|{today:%b %d %Y}|I thought."
    with pytest.raises(GenerationError, match=r"the chat template failed on the messages \(TypeError"):
        Engine.load(served[1], provider="cpu", chat_template="{{ messages[0].content + 1 }}").chat(ASK)

    url = served[0]
    opened = httpx.post(f"{url}/apply-template", json={"messages": ASK, "tools": []}, headers=AUTH).json()["prompt"]
    closed = httpx.post(f"{url}/apply-template", json={"messages": ASK, "add_generation_prompt": False}, headers=AUTH).json()["prompt"]
    assert opened == closed + "<|im_start|>assistant\n" and opened == engine.tokenizer.chat_prompt(ASK)[0]
    reply = client.chat.completions.create(model=served[1].name, messages=history, max_tokens=2)
    assert reply.usage.prompt_tokens == len(engine.tokenizer.chat_prompt(history)[1])
