"""`edgeinfer serve --ray`: the same server as Ray Serve replicas on a local Ray cluster, started as a
user starts it (a subprocess on a free localhost port), driven by the real openai client. Each
answer is compared with the SDK's, and the stream with the one `edgeinfer serve` sends."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import in_threads, linked_copy
from test_serve import free_port, long_export, start  # noqa: F401 - long_export is a fixture
from test_vision import idefics3, png  # noqa: F401 - idefics3 is a fixture
from test_vision_serve import QUESTION, data_url, expected, picture_site  # noqa: F401 - expected and picture_site are fixtures

from edgeinfer import Engine

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
pytestmark = pytest.mark.ray
CHAT = [{"role": "user", "content": "Hi"}]


def start_ray(export, *flags):
    """`edgeinfer serve --ray` and its base URL, once /health says every replica is ready (at most 120 s)."""
    port = free_port()
    log = open(export.parent / f"ray-{port}.log", "w+")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "serve",
            "--ray",
            "--model",
            str(export),
            "--port",
            str(port),
            "--provider",
            "cpu",
            *flags,
        ],
        stdout=log,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log.name).read_text()  # its own handle: a seek on the shared one moves the server's writes
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError("edgeinfer serve --ray did not start within 120 s")


def stop(process) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=60)


@pytest.fixture(scope="module")
def replicas(tiny_llama):
    process, url, log = start_ray(tiny_llama[1], "--replicas", "2", "--max-batch", "4")
    yield url, tiny_llama[1].name, log
    assert stop(process) == 0


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


def sse_payloads(response_text: str) -> list:
    """The stream's data lines, without what differs from run to run (id, created)."""
    payloads = []
    for line in response_text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else {k: v for k, v in json.loads(data).items() if k not in ("id", "created")})
    return payloads


def test_answers_and_streams_equal_the_sdk_and_edgeinfer_serve(replicas, engine, tiny_llama):
    import openai

    url, model, _ = replicas
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12)
    assert chat.choices[0].message.content == engine.generate(engine.chat_prompt(CHAT), max_new_tokens=12).text
    text = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=10)
    assert text.choices[0].text == engine.generate([5, 6, 7], max_new_tokens=10).text
    body = {"model": model, "messages": CHAT, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    through_ray = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    plain, plain_url = start(tiny_llama[1], "--provider", "cpu")
    try:
        direct = httpx.post(f"{plain_url}/v1/chat/completions", json=body, timeout=60)
    finally:
        plain.send_signal(signal.SIGTERM)
        plain.wait(timeout=30)
    assert through_ray.headers["content-type"].startswith("text/event-stream")
    assert sse_payloads(through_ray.text) == sse_payloads(direct.text) and len(sse_payloads(direct.text)) > 5


def test_concurrent_requests_spread_over_both_replicas(replicas, engine):
    url, model, _ = replicas
    prompts = [[5 + i, 6, 7] for i in range(8)]
    seen, answers = [None] * 8, [None] * 8

    def call(i):
        response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompts[i], "max_tokens": 16}, timeout=60)
        seen[i], answers[i] = response.headers["x-edgeinfer-replica"], response.json()["choices"][0]["text"]

    assert in_threads(call, 8) == []
    assert answers == [engine.generate(p, max_new_tokens=16).text for p in prompts]
    assert len(set(seen)) == 2, seen


def test_rays_own_tools_see_the_cluster_the_command_started(replicas):
    """The dashboard on loopback, `ray status` and `serve status` against the cluster, run as the
    server's log tells an operator (Ray's CLI sends the cluster's token in token mode only)."""
    url, model, log = replicas
    text = Path(log.name).read_text()  # its own handle: seeking the shared one would move the server's writes
    note = next(line for line in text.splitlines() if line.startswith("Ray dashboard: "))
    dashboard = note.split("Ray dashboard: ", 1)[1].split(";")[0]
    assert dashboard.startswith("http://127.0.0.1:")
    assert httpx.get(dashboard, timeout=30).status_code == 200
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    tool = lambda name: os.path.join(os.path.dirname(sys.executable), name)  # noqa: E731 - the environment's own
    status = subprocess.run([tool("ray"), "status"], capture_output=True, text=True, timeout=120, env=env)
    assert status.returncode == 0 and "Total Usage" in status.stdout and " CPU" in status.stdout, status.stderr[-2000:]
    serving = subprocess.run([tool("serve"), "status", "--address", dashboard], capture_output=True, text=True, timeout=120, env=env)
    assert serving.returncode == 0, serving.stderr[-2000:]
    assert "edgeinfer:" in serving.stdout and "HEALTHY" in serving.stdout and "RUNNING: 2" in serving.stdout


@contextmanager
def ingress(settings: str):
    """application(front=True) of `settings` (a ReplicaSettings(...) expression) deployed with
    serve.run in its own process, as a Ray user would, behind Ray's HTTP proxy: its base URL once
    /health says 200."""
    port = free_port()
    script = (
        "import sys, ray\nfrom ray import serve\nfrom edgeinfer.serve.replicas import ReplicaSettings, application\n"
        "ray.init(address='local', num_cpus=2, include_dashboard=False, logging_level='WARNING')\n"
        f"serve.start(http_options={{'host': '127.0.0.1', 'port': {port}}})\n"
        f"serve.run(application({settings}, front=True), route_prefix='/')\n"
        "print('deployed', flush=True)\nsys.stdin.read()\nserve.shutdown()\nray.shutdown()\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout.readline().strip() == "deployed"
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the front did not say ready within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        process.stdin.close()
        assert process.wait(timeout=60) == 0


def test_the_app_as_a_ray_serve_ingress_deployment_answers_as_the_sdk(tiny_llama, engine):
    """application(front=True): the same app as an ingress deployment behind Ray's HTTP proxy."""
    import openai

    with ingress(f"ReplicaSettings({str(tiny_llama[1])!r}, provider='cpu')") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=tiny_llama[1].name, messages=CHAT, max_tokens=12)
        assert chat.choices[0].message.content == engine.generate(engine.chat_prompt(CHAT), max_new_tokens=12).text
        stream = client.completions.create(model=tiny_llama[1].name, prompt=[5, 6, 7], max_tokens=10, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == engine.generate([5, 6, 7], max_new_tokens=10).text
        response = httpx.post(f"{url}/v1/completions", json={"model": tiny_llama[1].name, "prompt": [5], "temperature": -1})
        assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
        response = httpx.post(f"{url}/v1/completions", json={"model": tiny_llama[1].name, "prompt": [5], "max_tokens": 2})
        assert response.status_code == 200 and len(response.headers["x-edgeinfer-replica"]) >= 6


def test_pictures_go_to_the_replicas_and_the_front_deployment_fetches_urls_where_allowed(idefics3, expected, picture_site):
    """A picture travels with its request from the front to a replica, which encodes it; with
    ReplicaSettings(allowed_image_domains=("127.0.0.1",)) the front fetches an http(s) image a request
    names from that host."""
    site, asked = picture_site

    def body(url: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        return {"model": "vlm", "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0}

    with ingress(
        f"ReplicaSettings({str(idefics3[2])!r}, model_name='vlm', provider='cpu', allowed_image_domains=('127.0.0.1',))"
    ) as url:
        sent = httpx.post(f"{url}/v1/chat/completions", json=body(data_url(png(3))), timeout=120).json()
        fetched = httpx.post(f"{url}/v1/chat/completions", json=body(site), timeout=120).json()
    assert sent["choices"][0]["message"]["content"] == expected[0] == fetched["choices"][0]["message"]["content"]
    assert sent["usage"]["prompt_tokens"] == expected[1] and sent["usage"]["prompt_tokens_details"]["image_tokens"] == 9
    assert asked == ["/p.png"]


def test_a_folder_missing_on_a_node_is_a_clear_error_not_a_hang(tmp_path):
    """The replica's own error comes back through Ray (the folder exists where the command runs
    but not at the path the replicas were given: as on a node that lacks it)."""
    script = (
        "from edgeinfer.serve.replicas import ReplicaSettings, run_replicas\n"
        f"run_replicas(ReplicaSettings({str(tmp_path / 'absent')!r}, provider='cpu'), '127.0.0.1', {free_port()})\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and time.monotonic() - started < 120
    assert "the replicas could not start: NotAnExportError: model path" in done.stderr
    assert "must exist at the same path on every node" in done.stderr


def test_ray_flags_need_ray_and_an_unreachable_cluster_is_an_error(tiny_llama):
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(tiny_llama[1]), "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--replicas, --autoscale and --address apply to --ray" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", "--ray", "--model", str(tiny_llama[1]), "--autoscale", "3:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "is not MIN:MAX with 1 <= MIN <= MAX" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "serve", "--ray", "--model", str(tiny_llama[1]), "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "cannot reach the Ray cluster at 127.0.0.1:1" in done.stderr


def test_a_killed_replica_comes_back_and_the_other_keeps_answering(long_export):
    """Kill one replica's process while both decode long requests, whole and streamed: the other
    replica's requests end normally; those on the killed one end with an OpenAI-shaped 503 that says
    to retry (a stream already under way, with an error event in place of its end), but for one that
    ended before the kill; the next requests are all answered, and Ray Serve starts the replica again."""
    import os

    process, url, log = start_ray(long_export, "--replicas", "2")
    try:
        before = replica_pids(process)
        assert len(before) == 2
        outcomes = [None] * 6  # (replica, answered, status, error code, Retry-After, when it ended)
        streaming = threading.Semaphore(0)  # released at each stream's first tokens

        def call(i):
            body = {"model": long_export.name, "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "stream": i % 2 == 1}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    if len(lines) == 3 and body["stream"]:
                        streaming.release()
            text, replica = "\n".join(lines), response.headers.get("x-edgeinfer-replica")
            if body["stream"]:
                events = [line[6:] for line in lines if line.startswith("data: ")]
                answered = events[-1] == "[DONE]"
                error = None if answered else json.loads(events[-1])["error"]["code"]
            else:
                answered, error = response.status_code == 200, json.loads(text).get("error", {}).get("code")
            ended = time.monotonic()
            outcomes[i] = (replica, answered, response.status_code, error, response.headers.get("retry-after"), ended)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for _ in range(3):  # every request is decoding (3,000 tokens take several seconds)
            assert streaming.acquire(timeout=60)
        killed_at = time.monotonic()
        os.kill(before[0], signal.SIGKILL)
        for thread in threads:
            thread.join()
        lost = [o for o in outcomes if not o[1]]
        killed = {o[0] for o in lost} - {None}  # a 503 before the replica answered names none
        assert len(killed) <= 1 and 1 <= len(lost) <= 5 and all(o[3] == "engine_unavailable" for o in lost), outcomes
        assert len({o[0] for o in outcomes if o[1]} - killed) == 1, outcomes  # the other replica answered all its own
        # a request the killed replica answered had ended before the kill (a machine under load lets one finish first)
        assert all(o[5] < killed_at for o in outcomes if o[1] and o[0] in killed), outcomes
        assert all(o[2:5] == (503, "engine_unavailable", "1") for i, o in enumerate(outcomes) if i % 2 == 0 and not o[1]), outcomes
        assert all(o[2] == 200 for i, o in enumerate(outcomes) if i % 2 == 1), outcomes  # a stream's status went first
        after = [
            httpx.post(
                f"{url}/v1/completions", json={"model": long_export.name, "prompt": [5, 6], "max_tokens": 4}, timeout=60
            ).status_code
            for _ in range(10)
        ]
        assert after == [200] * 10
        deadline = time.monotonic() + 60
        while not (len(replica_pids(process)) == 2 and before[0] not in replica_pids(process)):
            assert time.monotonic() < deadline, "Ray Serve did not start the replica again within 60 s"
            time.sleep(0.5)
    finally:
        assert stop(process) == 0


def replica_pids(server) -> list[int]:
    """The replica processes of this server's local cluster (started in the server's session)."""
    import os

    listed = subprocess.run(["pgrep", "-f", "ServeReplica:edgeinfer"], capture_output=True, text=True).stdout
    pids = []
    for pid in map(int, listed.split()):
        try:
            if os.getsid(pid) == server.pid:
                pids.append(pid)
        except ProcessLookupError:
            pass
    return pids


def test_joining_a_running_cluster_deploys_there_and_leaves_it_running(tiny_llama):
    """`ray start --head` (token authentication off on both sides: see the README), then
    `edgeinfer serve --ray --address HOST:PORT`: it serves, and SIGTERM removes only its
    application; the cluster stays up."""
    import os

    import shutil
    import tempfile

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    port, scratch = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's sockets live under it
    started = subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--disable-usage-stats",
            "--include-dashboard=false",
            "--temp-dir",
            scratch,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    try:
        served_port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgeinfer.cli",
                "serve",
                "--ray",
                "--address",
                f"127.0.0.1:{port}",
                "--model",
                str(tiny_llama[1]),
                "--port",
                str(served_port),
                "--provider",
                "cpu",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{served_port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.stdout.read()
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{served_port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [tiny_llama[1].name]
        assert stop(server) == 0
        status = subprocess.run(
            [ray_bin, "status", "--address", f"127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0 and "1 node_" in status.stdout
    finally:  # this cluster's processes only (`ray stop` would stop every cluster on the machine)
        subprocess.run(["pkill", "-KILL", "-f", scratch], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def test_autoscaling_starts_a_second_replica_under_load(long_export):
    """--autoscale 1:2 with a batch of 2: one replica while idle; six long requests at once keep
    it above its target, and a second replica starts (within 60 s; Ray waits UPSCALE_DELAY_S)."""
    process, url, log = start_ray(long_export, "--autoscale", "1:2", "--max-batch", "2")
    try:
        assert len(replica_pids(process)) == 1
        stop_at = time.monotonic() + 60

        def load():
            while time.monotonic() < stop_at and len(replica_pids(process)) < 2:
                httpx.post(
                    f"{url}/v1/completions",
                    json={"model": long_export.name, "prompt": [5, 6], "max_tokens": 3000, "ignore_eos": True},
                    timeout=120,
                )

        threads = [threading.Thread(target=load) for _ in range(6)]
        for thread in threads:
            thread.start()
        while len(replica_pids(process)) < 2:
            assert time.monotonic() < stop_at, "no second replica within 60 s of load"
            time.sleep(0.5)
        for thread in threads:
            thread.join()
    finally:
        assert stop(process) == 0


def test_several_models_on_the_replicas_answer_each_as_alone(tiny_llama, chain_llama, tmp_path):
    """`serve --ray --models DIR`: every replica serves every model from its own pool."""
    import openai

    linked_copy(tiny_llama[1], tmp_path / "models" / "a")
    linked_copy(chain_llama[0], tmp_path / "models" / "b")
    port = free_port()
    log = open(tmp_path / "ray-several.log", "w+")
    command = [sys.executable, "-m", "edgeinfer.cli", "serve", "--ray", "--models", str(tmp_path / "models"), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--provider", "cpu", "--pin", "a"], stdout=log, stderr=log, text=True, start_new_session=True
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, Path(log.name).read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        for name in "ab":
            alone = Engine.load(tmp_path / "models" / name, provider="cpu").generate("Hi", max_new_tokens=8, ignore_eos=True).text
            done = client.completions.create(model=name, prompt="Hi", max_tokens=8, extra_body={"ignore_eos": True})
            assert (done.model, done.choices[0].text) == (name, alone)
        with pytest.raises(openai.NotFoundError, match="this server serves 'a', 'b'"):
            client.completions.create(model="c", prompt="Hi", max_tokens=2)
    finally:
        assert stop(process) == 0


def test_the_front_serves_the_chat_page_too(replicas):
    url, _, _ = replicas
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "/ui/app.js" in page.text and "script-src 'self'" in page.headers["content-security-policy"]
