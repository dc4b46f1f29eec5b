"""`edgeinfer serve` against hostile and sloppy clients, each driven the way a real one would be
(raw sockets where the bytes on the wire are the point), and the OpenAI details clients rely on:
n, batched prompts, cached tokens, the developer role, strict types, error shapes, CORS."""

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from test_serve import free_port, long_export, poll, server_log, start  # noqa: F401 - long_export is a fixture

from edgeinfer import Engine

KEY, METRICS_KEY, ORIGIN = "test-key", "metrics-key", "http://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]
LOOP_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite JSON has it


def nested(depth: int) -> dict:
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def server(tiny_llama):
    process, url = start(
        tiny_llama[1],
        "--max-batch",
        "4",
        "--api-key",
        KEY,
        "--metrics-key",
        METRICS_KEY,
        "--cors-origin",
        ORIGIN,
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--provider",
        "cpu",
    )
    yield url, tiny_llama[1].name, process
    process.kill()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


def metric(url: str, name: str, key: str | None = METRICS_KEY) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    lines = httpx.get(f"{url}/metrics", headers=headers).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " ") or line.startswith(name + "{"))


def post(url: str, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60, **kwargs)


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(server):
    url, model, _ = server
    with httpx.Client(headers={**AUTH, "content-type": "application/json"}, timeout=30) as http:
        for path, field, where, good in (
            (
                "/v1/chat/completions",
                '"messages": [{"role": "user", "content": "a\\ud800b"}]',
                "messages[0].content",
                {"messages": CHAT},
            ),
            ("/v1/completions", '"prompt": "a\\udfffb"', "prompt", {"prompt": "ab"}),
        ):
            response = http.post(f"{url}{path}", content=f'{{"model": "{model}", {field}, "max_tokens": 2}}'.encode())
            assert response.status_code == 400 and error_of(response)["param"] == where
            assert "lone surrogate" in error_of(response)["message"]
            again = http.post(f"{url}{path}", json={"model": model, "max_tokens": 2, **good})  # on the same connection
            assert again.status_code == 200
        paired = http.post(
            f"{url}/v1/completions", content=f'{{"model": "{model}", "prompt": "a\\ud83d\\ude42", "max_tokens": 2}}'.encode()
        )
        assert paired.status_code == 200  # a surrogate pair is an emoji


def test_schemas_past_the_parsers_depth_and_without_finite_json_are_400s(server, client):
    url, model, _ = server
    deep = post(
        url,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": CHAT,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(127)}},
        },
    )
    assert deep.status_code == 400 and error_of(deep)["param"] == "response_format"
    assert "recursion limit" in error_of(deep)["message"]
    too_deep = post(
        url,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(300)}},
        },
    )
    assert too_deep.status_code == 400 and "nested more than 512 levels" in error_of(too_deep)["message"]
    loop = {"type": "json_schema", "json_schema": {"name": "loop", "schema": LOOP_SCHEMA}}
    whole = post(url, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 20, "response_format": loop})
    assert whole.status_code == 400 and error_of(whole)["param"] == "response_format"
    assert "cannot match the JSON schema" in error_of(whole)["message"]
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        headers=AUTH,
        json={"model": model, "messages": CHAT, "max_tokens": 20, "response_format": loop, "stream": True},
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code == 200 and "cannot match the JSON schema" in json.loads(events[-1])["error"]["message"]
    assert all(choice.get("finish_reason") is None for e in events[:-1] for choice in json.loads(e)["choices"])


def test_a_non_streaming_client_that_leaves_frees_its_row(long_export):
    process, url = start(long_export, "--max-batch", "2", "--provider", "cpu")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"model": "long", "prompt": [5, 6, 7], "max_tokens": 16000}, timeout=0.5)
        poll(url, lambda: metric(url, "edgeinfer_running_rows", None) == 0, seconds=5)
        assert metric(url, "edgeinfer_cancelled_requests_total", None) == 1
        assert metric(url, "edgeinfer_generated_tokens_total", None) == 0  # it did not run to its end
        assert "cancelled: the client went away" in server_log(process)
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_huge_prompt_beside_a_stream_does_not_stall_it(long_export):
    """A 3.9 MB prompt and 60,000 tiny messages are refused at once, and a running stream keeps its pace meanwhile."""
    process, url = start(long_export, "--max-batch", "2", "--provider", "cpu")
    arrivals, stop = [], threading.Event()

    def stream():
        body = {"model": "long", "prompt": [5, 6, 7], "max_tokens": 16000, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                arrivals.append(time.monotonic())
                if stop.is_set():
                    return

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        poll(url, lambda: len(arrivals) > 20)
        for path, body in (
            ("/v1/completions", {"prompt": "Edge boxes run small models. " * 135000}),  # 3.9 MB
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 60000}),
        ):
            started = time.monotonic()
            big = httpx.post(f"{url}{path}", json={"model": "long", "max_tokens": 4, **body}, timeout=60)
            ended = time.monotonic()
            time.sleep(0.3)
            assert big.status_code == 400 and error_of(big)["code"] == "context_length_exceeded", big.text
            window = [t for t in arrivals if started - 0.5 <= t <= ended + 0.3]
            gap = max(b - a for a, b in zip(window, window[1:]))
            print(f"{path}: refused in {ended - started:.3f} s; the stream's largest gap meanwhile {gap:.3f} s")
            assert gap < 0.5  # validation, the template and the tokenizer run off the event loop
        stop.set()
        reader.join(30)
    finally:
        stop.set()
        process.kill()
        process.wait(timeout=30)


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), MiB."""
    line = next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_every_route_that_reads_text_refuses_what_the_context_cannot_hold_and_memory_comes_back(tiny_llama):
    """3.9 MB of text to each route that reads text (the counting routes and llama.cpp's /tokenize
    among them): a 400 in the API's shape naming the field, before any encoding; three at once to
    /tokenize, then the server's resident memory stays within 100 MiB of what it was."""
    import concurrent.futures

    process, url = start(tiny_llama[1], "--provider", "cpu")
    text = "Edge boxes run small models. " * 135000
    asked = {"model": tiny_llama[1].name}
    try:
        for path, body, param in (
            ("/tokenize", {"content": text}, "content"),
            ("/tokenize", {"prompt": text}, "prompt"),
            ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "messages"),
            ("/apply-template", {"messages": [{"role": "user", "content": text}]}, "messages"),
            ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": text}]}, "messages"),
            ("/v1/responses/input_tokens", {"input": text}, "input"),
            ("/v1/completions", {"prompt": text, "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}, "messages"),
            ("/v1/responses", {"input": text, "max_output_tokens": 2}, "input"),
            ("/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}, "messages"),
        ):
            refused = httpx.post(f"{url}{path}", json={**asked, **body}, timeout=60)
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert (error["code"] if "code" in error else error["type"]) in ("context_length_exceeded", "invalid_request_error"), error
            assert "the context is 256" in error["message"] and (error.get("param") in (param, None)), (path, error)
        before = rss_mib(process.pid)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60), range(3)))
        assert [a.status_code for a in answers] == [400] * 3
        time.sleep(1)
        assert rss_mib(process.pid) < before + 100, (before, rss_mib(process.pid))
        assert httpx.post(f"{url}/tokenize", json={"content": "Hello"}, timeout=60).json()["tokens"]  # and it goes on
    finally:
        process.kill()
        process.wait(timeout=30)


def test_metrics_keep_their_size_whatever_paths_are_asked_and_need_their_key(server):
    url = server[0]
    assert httpx.get(f"{url}/metrics").status_code == 401  # --metrics-key
    assert httpx.get(f"{url}/metrics", headers=AUTH).status_code == 401  # the API key is not the metrics key
    with httpx.Client() as http:
        for i in range(20):
            http.get(f"{url}/nothing-{i}")
        http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})  # its own line exists from now on
        size = len(httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text)
        for i in range(1000):
            http.get(f"{url}/nothing-else-{i}")
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    assert abs(len(text) - size) < 20, (len(text), size)  # only the counts' digits change
    assert metric(url, 'edgeinfer_requests_total{path="other",status="404"}') >= 1020
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():
        for _ in range(5):
            yield b" " * 2**20

    response = httpx.post(f"{server[0]}/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def raw(url: str, data: bytes, wait: float = 5.0) -> tuple[bytes, float]:
    """Send `data` on a new connection; what comes back until the server closes it, and when."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        started = time.monotonic()
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
        return received, time.monotonic() - started


def test_clients_that_stall_are_cut_off(server):
    """--header-timeout 1 and --body-timeout 1: silence, unfinished headers and a short body."""
    url = server[0]
    silent, after = raw(url, b"")
    assert silent == b"" and 0.9 < after < 3
    partial, after = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert partial.startswith(b"HTTP/1.1 408") and b"request_timeout" in partial and after < 3
    short, after = raw(
        url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"',
    )
    assert short.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in short and after < 3


def test_keys_compare_whole_and_an_empty_key_is_refused(server, tiny_llama):
    url, model, _ = server
    for key in ("-", KEY[:-1], KEY + "x", KEY.upper()):
        response = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "x"}, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 401
    for flag in ("--api-key", "--metrics-key"):
        done = subprocess.run(
            [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(tiny_llama[1]), flag, "", "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "an empty key would turn authentication off" in done.stderr


def test_cors_preflight_needs_no_key_and_other_origins_are_refused(server):
    url, model, _ = server
    asked = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    preflight = httpx.options(f"{url}/v1/chat/completions", headers=asked)
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "x-stainless-os" in preflight.headers["access-control-allow-headers"]
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(f"{url}/v1/chat/completions", headers={**asked, "Origin": "http://evil.example"})
    assert other.status_code == 403 and "--cors-origin http://evil.example" in error_of(other)["message"]
    call = httpx.post(
        f"{url}/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 2}, headers={**AUTH, "Origin": ORIGIN}
    )
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in httpx.get(f"{url}/health", headers={"Origin": "http://evil.example"}).headers


def test_n_choices_are_seeded_apart_and_share_the_prompts_prefill(server, client, engine):
    url, model, _ = server
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    reply = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [
        engine.generate(prompt, max_new_tokens=8, temperature=1.0, seed=11 + i).text for i in range(3)
    ]
    assert reply.usage.prompt_tokens == 100 and reply.usage.completion_tokens == 24
    hits = metric(url, "edgeinfer_prefix_cache_hit_tokens")
    fresh = [(11 * i) % 290 + 4 for i in range(100)]
    client.completions.create(model=model, prompt=fresh, n=3, max_tokens=2)
    assert metric(url, "edgeinfer_prefix_cache_hit_tokens") - hits == 2 * 96  # choices 1 and 2 start from choice 0's blocks
    greedy = client.chat.completions.create(model=model, messages=CHAT, n=2, max_tokens=6)
    expected = engine.generate(engine.chat_prompt(CHAT), max_new_tokens=6).text
    assert [c.message.content for c in greedy.choices] == [expected, expected]
    texts = {}
    for chunk in client.chat.completions.create(model=model, messages=CHAT, n=2, max_tokens=6, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: expected, 1: expected}


def test_completions_take_a_list_of_prompts_one_choice_each(server, client, engine):
    model = server[1]
    prompts = ["The capital of France is", "Edge boxes"]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=6)
    assert [c.text for c in reply.choices] == [engine.generate(p, max_new_tokens=6).text for p in prompts]
    ids = [[5, 6, 7], [8, 9]]
    twice = client.completions.create(model=model, prompt=ids, max_tokens=5, n=2)
    expected = [engine.generate(p, max_new_tokens=5).text for p in ids]
    assert [c.text for c in twice.choices] == [expected[0], expected[0], expected[1], expected[1]]
    assert twice.usage.prompt_tokens == 5 and twice.usage.completion_tokens == 20


def test_usage_reports_cached_tokens_and_responses_carry_a_fingerprint(server, client, engine):
    model = server[1]
    prompt = [(13 * i) % 280 + 5 for i in range(70)]
    first = client.completions.create(model=model, prompt=prompt + [1], max_tokens=2)
    second = client.completions.create(model=model, prompt=prompt + [2], max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 64  # two whole blocks of 32
    assert first.system_fingerprint.startswith("fp_") and first.system_fingerprint == second.system_fingerprint
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, stream=True))
    assert {c.system_fingerprint for c in chunks} == {first.system_fingerprint}


def test_the_developer_role_is_the_system_role_and_agent_histories_validate(server, client, engine):
    url, model, _ = server
    developer = client.chat.completions.create(
        model=model, messages=[{"role": "developer", "content": "Be brief."}, *CHAT], max_tokens=6
    )
    system = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert developer.choices[0].message.content == engine.generate(engine.chat_prompt(system), max_new_tokens=6).text
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "And?"}]
    response = post(url, "/v1/chat/completions", {"model": model, "messages": history, "max_tokens": 2})
    assert response.status_code == 400 and "does not render tool calls" in error_of(response)["message"]  # the schema took it
    no_content = post(url, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": None}]})
    assert no_content.status_code == 400 and error_of(no_content)["param"] == "messages[0]"


@pytest.mark.parametrize(
    "asked, param, message",
    [
        ({"max_tokens": True}, "max_tokens", "valid integer"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"temperature": "0.5"}, "temperature", "valid number"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"seed": 2**64}, "seed", "less than or equal to"),
        ({"max_tokens": 250}, "max_tokens", "ask for at most"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "Input should be"),
    ],
)
def test_strict_types_and_the_context_rule(server, asked, param, message):
    url, model, _ = server
    response = post(url, "/v1/chat/completions", {"model": model, "messages": CHAT, **asked})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and message in error["message"] and not error["message"].startswith("None")


def test_error_shapes_for_bodies_that_are_not_requests(server):
    url = server[0]
    bad_json = httpx.post(f"{url}/v1/completions", content=b'{"model": "x", ', headers={**AUTH, "content-type": "application/json"})
    assert bad_json.status_code == 400 and error_of(bad_json)["param"] is None
    assert "not valid JSON" in error_of(bad_json)["message"]
    as_curl_sends_it = httpx.post(
        f"{url}/v1/completions",
        content=json.dumps({"model": server[1], "prompt": "ab", "max_tokens": 1}),
        headers={**AUTH, "content-type": "application/x-www-form-urlencoded"},
    )
    assert as_curl_sends_it.status_code == 200 and as_curl_sends_it.json()["usage"]["completion_tokens"] == 1
    array = post(url, "/v1/completions", [1, 2])
    assert array.status_code == 400 and error_of(array)["message"].startswith("the request body")
    for method, path, code in (("GET", "/v1/nope", "unknown_url"), ("GET", "/v1/completions", "method_not_allowed")):
        response = httpx.request(method, f"{url}{path}", headers=AUTH)
        assert error_of(response)["code"] == code and not error_of(response)["code"].isdigit()


def test_options_and_405s_name_every_method_of_the_path(server):
    """/v1/responses/ID takes GET and DELETE: OPTIONS says both (204), and a PUT's 405 lists both."""
    url = server[0]
    asked = httpx.request("OPTIONS", f"{url}/v1/responses/resp_x", headers=AUTH)
    assert asked.status_code == 204 and asked.headers.get_list("allow") == ["DELETE, GET, OPTIONS"]
    put = httpx.put(f"{url}/v1/responses/resp_x", headers=AUTH)
    assert put.status_code == 405 and put.headers.get_list("allow") == ["DELETE, GET, OPTIONS"]
    assert error_of(put)["code"] == "method_not_allowed" and "use DELETE, GET, OPTIONS" in error_of(put)["message"]
    assert httpx.request("OPTIONS", f"{url}/v1/chat/completions", headers=AUTH).headers["allow"] == "POST, OPTIONS"


def test_a_dangling_ref_in_a_tool_schema_is_named_in_the_clients_words(server):
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}},
    }
    body = {"model": server[1], "messages": CHAT, "tools": [tool], "tool_choice": "required", "max_tokens": 4}
    error = error_of(post(server[0], "/v1/chat/completions", body))
    assert error["param"] == "tools" and "tools[0].function.parameters refers to '#/$defs/Missing'" in error["message"]
    assert "edgeinfer" not in error["message"], error


def test_counting_refuses_a_thought_budget_as_generating_does(server):
    """thinking (Messages) and thinking_token_budget (Responses) on a model that does not think:
    the counting routes refuse them in the words the generating routes use."""
    url, model = server[0], server[1]
    thinking = {"model": model, "messages": CHAT, "thinking": {"type": "enabled", "budget_tokens": 16}}
    counted, made = post(url, "/v1/messages/count_tokens", thinking), post(url, "/v1/messages", {**thinking, "max_tokens": 8})
    assert counted.status_code == made.status_code == 400 and counted.json()["error"] == made.json()["error"]
    assert "thinking.budget_tokens needs a model that thinks" in counted.json()["error"]["message"]
    budget = {"model": model, "input": "Hi", "thinking_token_budget": 16}
    counted, made = post(url, "/v1/responses/input_tokens", budget), post(url, "/v1/responses", {**budget, "max_output_tokens": 8})
    assert counted.status_code == made.status_code == 400 and error_of(counted) == error_of(made)
    assert error_of(counted)["param"] == "thinking_token_budget"


def test_the_openapi_description_is_served_with_the_real_ranges(server):
    spec = httpx.get(f"{server[0]}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(spec["paths"])
    fields = spec["components"]["schemas"]["ChatRequest"]["properties"]
    penalty = next(option for option in fields["presence_penalty"]["anyOf"] if option.get("type") == "number")
    assert (penalty["minimum"], penalty["maximum"]) == (-2, 2)
    assert next(o for o in fields["n"]["anyOf"] if o.get("type") == "integer")["maximum"] == 16
