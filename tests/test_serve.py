"""`edgeinfer serve` as a real subprocess on a free localhost port with the tiny llama, driven by the
real openai client, and by raw HTTP where the stream's exact bytes matter. Every answer is compared
with what the SDK gives for the same prompt alone."""

import atexit
import json
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import CHAIN_TEXT, in_threads

from edgeinfer import Engine

KEY = "test-key"
CHAT = [{"role": "user", "content": "Hi"}]


# the logs of servers started without an export (several models), removed when the test session ends
_LOGS = Path(tempfile.mkdtemp(prefix="edgeinfer-serve-logs-"))
atexit.register(shutil.rmtree, _LOGS, True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(export, *flags):
    """A server process of `export` (None: the models `flags` name) and its base URL, once /health
    says 200 (polled, at most 60 s). Its log goes to a file beside the export (or in the test
    session's log folder, `_LOGS`), read back by `log(process)`."""
    port = free_port()
    log = open((export.parent if export else _LOGS) / f"serve-{port}.log", "w+")
    model = ["--model", str(export)] if export else []
    process = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer.cli", "serve", *model, "--port", str(port), *flags],
        stdout=log,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    process.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, server_log(process)
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError("the server did not become healthy within 60 s")


@pytest.fixture(scope="module")
def server(tiny_llama):
    process, url = start(tiny_llama[1], "--max-batch", "4", "--max-queue", "2", "--api-key", KEY, "--provider", "cpu")
    yield url, tiny_llama[1].name
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


def server_log(process) -> str:
    """The server's log so far, read through a handle of its own (seeking the one the server writes
    through would move where its next lines go)."""
    return Path(process.log.name).read_text()


def poll(url: str, condition, seconds: float = 30) -> None:
    """Wait for `condition()` (at most `seconds`): the scheduler acts at its next step."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in time"
        time.sleep(0.02)


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ") or line.startswith(name + "{"))


def test_chat_and_completions_answer_what_the_sdk_answers(server, client, engine):
    model = server[1]
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12)
    expected = engine.generate(engine.chat_prompt(CHAT), max_new_tokens=12)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (expected.text, "length")
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (expected.prompt_tokens, 12)
    text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=10)
    assert text.choices[0].text == engine.generate("The capital of France is", max_new_tokens=10).text
    ids = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=10, stop=["e"])
    alone = engine.generate([5, 6, 7], max_new_tokens=10, stop=["e"])
    assert (ids.choices[0].text, ids.choices[0].finish_reason) == (alone.text, "stop" if alone.finish_reason != "length" else "length")
    assert [m.id for m in client.models.list().data] == [model]


def test_content_parts_user_and_max_completion_tokens_as_openai_clients_send_them(server, client, engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    reply = client.chat.completions.create(model=server[1], messages=parts, max_completion_tokens=9, user="someone")
    expected = engine.generate(engine.chat_prompt(CHAT), max_new_tokens=9)  # the parts join to "Hi"
    assert (reply.choices[0].message.content, reply.usage.completion_tokens) == (expected.text, 9)


@pytest.fixture(scope="module")
def chain_server(chain_llama):
    """A server of the llama that spells CHAIN_TEXT (multi-byte characters one byte a token), then EOS."""
    process, url = start(chain_llama[0], "--provider", "cpu")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), chain_llama[0].name
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def test_ignore_eos_as_an_extra_field_keeps_generating_past_the_models_eos(chain_server):
    client, model = chain_server
    plain = client.completions.create(model=model, prompt=[1], max_tokens=30)
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == ("".join(CHAIN_TEXT), "stop")  # the model's EOS
    past = client.completions.create(model=model, prompt=[1], max_tokens=30, extra_body={"ignore_eos": True})
    assert (past.choices[0].finish_reason, past.usage.completion_tokens) == ("length", 30)


def test_logprob_bytes_join_to_the_text_where_characters_span_tokens(chain_llama):
    """Chat's logprobs as the server shapes them, on the llama that spells multi-byte characters one
    byte a token: each token's bytes, joined, are the text's bytes."""
    from edgeinfer.serve.openai import ChatReply

    engine = Engine.load(chain_llama[0], provider="cpu")
    result = engine.generate([1], max_new_tokens=30, logprobs=True, top_logprobs=2)
    content = ChatReply("m", engine.tokenizer.token_bytes).whole([result])["choices"][0]["logprobs"]["content"]
    assert result.text == "".join(CHAIN_TEXT) and len(content) == len(result.token_ids)
    assert b"".join(bytes(c["bytes"]) for c in content) == result.text.encode()
    assert any(len(c["bytes"]) == 1 and c["bytes"][0] >= 0x80 for c in content)  # part of a character
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)  # the chain's token is the most likely


def test_seeded_sampling_is_reproducible_and_equals_the_sdk(server, client, engine):
    asked = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    first = client.completions.create(model=server[1], prompt="Edge boxes", **asked).choices[0].text
    assert client.completions.create(model=server[1], prompt="Edge boxes", **asked).choices[0].text == first
    assert first == engine.generate("Edge boxes", max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7).text
    extra = client.completions.create(
        model=server[1], prompt="Edge boxes", max_tokens=16, seed=7, extra_body={"top_k": 3, "temperature": 1.0}
    )
    assert extra.choices[0].text == engine.generate("Edge boxes", max_new_tokens=16, seed=7, top_k=3, temperature=1.0).text


def test_the_stream_is_what_openai_clients_parse(server, engine):
    body = {"model": server[1], "messages": CHAT, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block for block in raw.split("\n\n") if block]
    assert all(block.startswith("data: ") and "\n" not in block for block in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(block[6:]) for block in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == engine.generate(engine.chat_prompt(CHAT), max_new_tokens=10).text


@pytest.mark.parametrize(
    "asked, status, message",
    [
        ({"functions": [{"name": "f"}]}, 400, "'functions' is not supported by edgeinfer yet"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, 400, r"tools\[0\]\.function\.name must be"),
        ({"tool_choice": "required"}, 400, "tool_choice needs tools"),
        ({"presence_penalty": 5}, 400, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
        ({"logit_bias": {"99999": 1}}, 400, r"logit_bias \[99999\] are outside the vocabulary"),
        ({"response_format": {"type": "regex", "pattern": "[a-"}}, 400, "the regex cannot be used"),
        ({"response_format": {"type": "json_schema"}}, 400, r"response_format json_schema needs"),
        ({"top_p": 3}, 400, r"top_p must be a number in \(0, 1\]"),
        ({"bogus": 1}, 400, "unknown parameter 'bogus'"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"model": "other"}, 404, "the model 'other' is not served here"),
    ],
)
def test_bad_requests_get_openai_errors_that_name_the_problem(server, asked, status, message):
    body = {"model": server[1], "messages": CHAT, "max_tokens": 4, **asked}
    response = httpx.post(f"{server[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert __import__("re").search(message, error["message"]), error


def test_constraints_through_the_openai_client(server, client, engine):
    """response_format (OpenAI's json_schema, edgeinfer's regex) and choice, on both endpoints;
    each answer is the SDK's for the same settings."""
    schema = {"enum": ["red", "green", "blue"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}}
    for seed in range(4):
        reply = client.chat.completions.create(model=server[1], messages=CHAT, temperature=1.0, seed=seed, response_format=fmt)
        assert json.loads(reply.choices[0].message.content) in schema["enum"]
        assert (
            reply.choices[0].message.content
            == engine.generate(engine.chat_prompt(CHAT), temperature=1.0, seed=seed, response_format=fmt).text
        )
    regex = {"type": "regex", "pattern": "[0-9]{3}"}
    text = (
        client.completions.create(model=server[1], prompt="Edge boxes", temperature=1.0, seed=3, extra_body={"response_format": regex})
        .choices[0]
        .text
    )
    assert (
        __import__("re").fullmatch("[0-9]{3}", text)
        and text == engine.generate("Edge boxes", temperature=1.0, seed=3, response_format=regex).text
    )
    picked = client.completions.create(model=server[1], prompt="Edge boxes", extra_body={"choice": ["yes", "no"]})
    assert picked.choices[0].text in ("yes", "no") and picked.choices[0].finish_reason == "stop"


def test_logprobs_in_openais_shapes(server, client, engine):
    expected = engine.generate(engine.chat_prompt(CHAT), max_new_tokens=8, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(model=server[1], messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [round(c.logprob, 5) for c in content] == [round(c.logprob, 5) for c in expected.logprobs]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    legacy = client.completions.create(model=server[1], prompt="Edge boxes", max_tokens=6, logprobs=2).choices[0].logprobs
    alone = engine.generate("Edge boxes", max_new_tokens=6, logprobs=True, top_logprobs=2)
    assert [round(v, 5) for v in legacy.token_logprobs] == [round(c.logprob, 5) for c in alone.logprobs]
    # the legacy top_logprobs are keyed by the token's text: two tokens that spell the same (parts of
    # characters, shown as U+FFFD) share one key
    assert len(legacy.tokens) == len(alone.token_ids) and all(1 <= len(top) <= 2 for top in legacy.top_logprobs)
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(len(legacy.tokens))]
    body = {"model": server[1], "messages": CHAT, "max_tokens": 8, "stream": True, "logprobs": True}
    with httpx.stream("POST", f"{server[0]}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [c for chunk in chunks for choice in chunk["choices"] if choice["logprobs"] for c in choice["logprobs"]["content"]]
    assert [round(c["logprob"], 5) for c in streamed] == [round(c.logprob, 5) for c in expected.logprobs]


def test_penalties_and_bias_equal_the_sdk(server, client, engine):
    asked = dict(max_tokens=12, presence_penalty=0.8, frequency_penalty=0.6, logit_bias={"5": 3.0})
    reply = client.completions.create(model=server[1], prompt="Edge boxes", **asked)
    alone = engine.generate("Edge boxes", max_new_tokens=12, presence_penalty=0.8, frequency_penalty=0.6, logit_bias={5: 3.0})
    assert reply.choices[0].text == alone.text != engine.generate("Edge boxes", max_new_tokens=12).text


def test_context_key_size_and_unknown_paths(server, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server[1], prompt=[5] * 300, max_tokens=4)
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "prompt"
    assert "300 tokens" in error.value.body["message"] and "256" in error.value.body["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{server[0]}/v1/completions", json={"model": server[1], "prompt": "x"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    big = httpx.post(
        f"{server[0]}/v1/completions",
        content=b"{" + b" " * (5 * 2**20) + b"}",
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert big.status_code == 413 and "over" in big.json()["error"]["message"]
    assert httpx.get(f"{server[0]}/v2/nothing").json()["error"]["code"] == "unknown_url"


def test_sixteen_concurrent_streams_each_get_their_solo_answer(server, engine):
    prompts = [[5 + i] * (3 + 13 * i) for i in range(16)]  # 3 to 198 tokens
    expected = [engine.generate(p, max_new_tokens=12 + i).text for i, p in enumerate(prompts)]
    texts = [None] * 16
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=8)  # the queue holds 2: retry a 429

    def call(i):
        stream = client.completions.create(model=server[1], prompt=prompts[i], max_tokens=12 + i, stream=True)
        texts[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    errors = in_threads(call, 16)
    assert errors == [] and texts == expected


@pytest.fixture(scope="module")
def long_export(tmp_path_factory):
    """The tiny llama with a 16384-token context: a request of 16000 tokens runs for seconds (4000
    took about one)."""
    from conftest import build_llama

    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("long")
    build_llama(root / "hf", context=16384)
    export_model(str(root / "hf"), root / "long")
    return root / "long"


def test_a_full_queue_is_a_429_with_retry_after_and_a_disconnect_frees_the_row(long_export):
    process, url = start(long_export, "--max-batch", "4", "--max-queue", "2", "--provider", "cpu")
    body = {"model": "long", "prompt": [5, 6, 7], "max_tokens": 16000, "stream": True}
    try:
        with httpx.Client(timeout=60) as http:
            streams = [http.stream("POST", f"{url}/v1/completions", json=body) for _ in range(6)]
            responses = [s.__enter__() for s in streams]  # 4 rows run, 2 wait: the queue is full
            refused = http.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full" and "max_queue 2" in refused.json()["error"]["message"]
            readers = [response.iter_lines() for response in responses[:4]]  # kept: a dropped reader closes its connection
            for reader in readers:
                next(reader)
            state = (metric(url, "edgeinfer_running_rows"), metric(url, "edgeinfer_queue_length"))
            assert state == (4, 2), (state, server_log(process))
            for stream in streams[4:]:
                stream.__exit__(None, None, None)  # the two waiting clients go away: they leave the queue
            poll(url, lambda: metric(url, "edgeinfer_queue_length") == 0)
            assert (metric(url, "edgeinfer_running_rows"), metric(url, "edgeinfer_cancelled_requests_total")) == (4, 2)
            for stream in streams[:4]:
                stream.__exit__(None, None, None)  # the running ones go away mid-stream: their rows are freed
        poll(url, lambda: metric(url, "edgeinfer_running_rows") == 0)
        assert metric(url, "edgeinfer_cancelled_requests_total") == 6
        assert metric(url, "edgeinfer_generated_tokens_total") == 0  # none of them ran to its end
        cancelled = [line for line in server_log(process).splitlines() if "cancelled: the client went away after" in line]
        assert [line.endswith("after 0 tokens") for line in cancelled] == [True] * 2 + [False] * 4  # the waiting two never ran
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_repeated_start_comes_from_the_prefix_cache(server, client, engine):
    """The server's rows reuse the blocks an earlier request left, with the same answer, and
    /metrics counts the tokens."""
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    before = metric(server[0], "edgeinfer_prefix_cache_hit_tokens")
    first = client.completions.create(model=server[1], prompt=prompt + [5], max_tokens=6).choices[0].text
    second = client.completions.create(model=server[1], prompt=prompt + [6], max_tokens=6).choices[0].text
    assert metric(server[0], "edgeinfer_prefix_cache_hit_tokens") - before == 96  # 3 whole blocks of 32
    assert metric(server[0], "edgeinfer_prefix_cache_bytes") > 0
    assert (first, second) == (
        engine.generate(prompt + [5], max_new_tokens=6).text,
        engine.generate(prompt + [6], max_new_tokens=6).text,
    )


def test_a_server_without_the_prefix_cache_keeps_nothing(tiny_llama, engine):
    process, url = start(tiny_llama[1], "--prefix-cache", "0", "--provider", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        prompt = [(7 * i) % 300 + 3 for i in range(100)] + [5]
        answers = [client.completions.create(model=tiny_llama[1].name, prompt=prompt, max_tokens=6).choices[0].text for _ in range(2)]
        assert answers == [engine.generate(prompt, max_new_tokens=6).text] * 2
        assert metric(url, "edgeinfer_prefix_cache_hit_tokens") == 0 and metric(url, "edgeinfer_prefix_cache_bytes") == 0
        assert metric(url, "edgeinfer_prefix_cache_miss_tokens") == 0  # the cache is off: nothing is looked up
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_the_metrics_add_up(server, client):
    before = {name: metric(server[0], name) for name in ("edgeinfer_generated_tokens_total", "edgeinfer_prompt_tokens_total")}
    statuses = metric(server[0], 'edgeinfer_requests_total{path="/v1/completions",status="200"}')
    made = [client.completions.create(model=server[1], prompt=[5] * n, max_tokens=n).usage for n in (3, 7, 11)]
    assert metric(server[0], "edgeinfer_generated_tokens_total") - before["edgeinfer_generated_tokens_total"] == sum(
        u.completion_tokens for u in made
    )
    assert metric(server[0], "edgeinfer_prompt_tokens_total") - before["edgeinfer_prompt_tokens_total"] == sum(
        u.prompt_tokens for u in made
    )
    assert metric(server[0], 'edgeinfer_requests_total{path="/v1/completions",status="200"}') == statuses + 3


def test_sigterm_lets_running_requests_end_with_length_and_exits_0(long_export):
    process, url = start(long_export, "--max-batch", "2", "--grace", "0.5", "--provider", "cpu")
    body = {"model": "long", "prompt": [5, 6, 7], "max_tokens": 16000, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    chunks = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) < 15000  # ended by the grace period, not by max_tokens
    assert process.wait(timeout=30) == 0
    assert "stopping: no new requests" in server_log(process)


def test_a_model_that_cannot_load_ends_the_server_with_its_error(tmp_path):
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(tmp_path / "missing"), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert done.returncode == 1 and "error: model path" in done.stderr and "does not exist" in done.stderr


def test_the_chat_page_and_its_files_are_served_with_a_strict_policy_and_no_ui_turns_it_off(server, tiny_llama):
    url, _ = server
    page = httpx.get(f"{url}/")
    policy = page.headers["content-security-policy"]
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html") and '<script src="/ui/app.js"' in page.text
    assert "script-src 'self';" in policy and "default-src 'none';" in policy and "unsafe" not in policy
    script = httpx.get(f"{url}/ui/app.js")
    assert (
        script.status_code == 200 and script.headers["content-type"].startswith("text/javascript") and "renderMarkdown" in script.text
    )
    assert httpx.get(f"{url}/ui/../app.py").status_code == 404 and httpx.get(f"{url}/ui/nope.js").status_code == 404
    icon = httpx.get(f"{url}/favicon.ico")  # browsers ask for it on their own: not a 404 in every log
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml" and icon.content.startswith(b"<svg")
    assert '<link rel="icon" href="/ui/favicon.svg"' in page.text and httpx.get(f"{url}/ui/favicon.svg").content == icon.content
    # the libraries the install fetched (serve/ui_vendor.py), each before the page's own script
    for name in ("marked.js", "purify.js", "highlight.js", "katex.js", "highlight.css"):
        tag = f'src="/ui/vendor/{name}"' if name.endswith(".js") else f'href="/ui/vendor/{name}"'
        assert tag in page.text and page.text.index(tag) < page.text.index('src="/ui/app.js"'), name
        library = httpx.get(f"{url}/ui/vendor/{name}")
        assert library.status_code == 200 and library.headers["content-security-policy"] == policy and len(library.content) > 1000
    assert httpx.get(f"{url}/ui/vendor/versions.json").status_code == 404 and httpx.get(f"{url}/ui/vendor/app.js").status_code == 404
    process, plain = start(tiny_llama[1], "--provider", "cpu", "--no-ui")
    try:
        assert httpx.get(f"{plain}/").status_code == 404 and httpx.get(f"{plain}/ui/app.js").status_code == 404
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
