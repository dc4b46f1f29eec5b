"""`edgeinfer serve`'s newer surfaces (Responses, Messages, tools, the model pool) against what a
hostile or sloppy client sends, each driven with the real clients or raw sockets: no 500, every
refusal in the API's own shape naming the field and the way out, and the connection still usable."""

import json
import signal
import socket

import anthropic
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
    process, url = start(export, "--provider", "cpu", "--max-batch", "2", "--api-key", KEY)
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
