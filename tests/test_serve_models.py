"""`edgeinfer serve` with several models (issue 31): a real server subprocess over three tiny exports
and a memory limit that holds two, driven by the openai client. Models load on their first
request, the least recently used idle one goes to make room (/v1/models and /metrics say so), a
pinned model stays, and every answer equals the SDK's for that model alone."""

import shutil
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from conftest import linked_copy
from test_serve import metric, poll, server_log, start

from edgeinfer import Engine
from edgeinfer.sdk.pool import _planned_bytes

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def folder(tiny_llama, chain_llama, tmp_path_factory):
    """A folder of three exports (--models): the tiny llama twice over (a and c) and the chain llama (b)."""
    root = tmp_path_factory.mktemp("models")
    linked_copy(tiny_llama[1], root / "a")
    linked_copy(chain_llama[0], root / "b")
    linked_copy(tiny_llama[1], root / "c")
    return root


def _limit_mib(folder) -> int:
    """MiB that hold any two of the three models' plans (max batch 2) but not all three."""
    sizes = sorted(_planned_bytes(folder / n, {"max_batch": 2}) for n in "abc")
    mib = -(-(sizes[-1] + sizes[-2]) // 2**20)  # rounded up
    assert mib * 2**20 < sum(sizes), "a limit in whole MiB cannot tell two of these models from three"
    return mib


def _start(*flags):
    return start(None, "--provider", "cpu", "--max-batch", "2", *flags)


def _stop(process):
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    process.log.close()


def _loaded(url) -> dict:
    return {m["id"]: m["loaded"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def _alone(export, tokens=8) -> str:
    return Engine.load(export, provider="cpu").generate(PROMPT, max_new_tokens=tokens, ignore_eos=True).text


def test_models_load_on_request_and_the_least_recently_used_goes(folder):
    process, url = _start("--models", str(folder), "--memory-limit", str(_limit_mib(folder)), "--pin", "a")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert _loaded(url) == {"a": True, "b": False, "c": False}  # the pinned one loads at start
        expected = {name: _alone(folder / name) for name in "abc"}
        for name in ["b", "a", "c"]:  # c needs room: b, the least recently used unpinned, goes
            done = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
            assert (done.model, done.choices[0].text) == (name, expected[name])
        assert _loaded(url) == {"a": True, "b": False, "c": True}
        assert metric(url, "edgeinfer_model_unloads_total") == 1 and metric(url, "edgeinfer_models_loaded") == 2
        assert metric(url, "edgeinfer_model_loads_total") == 3
        log = server_log(process)
        assert "loading model 'b' for a request" in log and "unloaded model 'b', the least recently used idle one" in log

        answers = {}

        def ask(name):
            done = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
            answers.setdefault(name, []).append(done.choices[0].text)

        threads = [threading.Thread(target=ask, args=(n,)) for n in ["a", "c", "a", "c"]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert answers == {"a": [expected["a"]] * 2, "c": [expected["c"]] * 2}

        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="d", prompt=PROMPT, max_tokens=2)
        assert "the model 'd' is not served here: this server serves 'a', 'b', 'c'" in str(refused.value)
    finally:
        _stop(process)


def test_keep_alive_zero_unloads_idle_models(folder):
    process, url = _start("--model", str(folder / "a"), "--model", str(folder / "b"), "--keep-alive", "0")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        client.completions.create(model="b", prompt=PROMPT, max_tokens=4)
        poll(url, lambda: _loaded(url) == {"a": False, "b": False}, seconds=10)
        assert "unloaded model 'b': idle for 0 s" in server_log(process)
    finally:
        _stop(process)


def test_a_model_larger_than_the_limit_is_a_400_with_the_figures(folder, tmp_path):
    process, url = _start("--models", str(folder), "--memory-limit", "1", "--max-batch", "1024")  # 1,024 rows of KV cache
    try:
        refused = httpx.post(f"{url}/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 400
        assert (
            "model 'a' needs" in refused.json()["error"]["message"]
            and "the memory limit is 1.0 MiB" in refused.json()["error"]["message"]
        )
    finally:
        _stop(process)


def test_bad_model_sets_are_refused_in_one_line(folder, tmp_path):
    shutil.copytree(folder / "a", tmp_path / "one" / "a")
    for flags, message in [
        (["--models", str(tmp_path / "none")], "is not a folder"),
        (["--models", str(tmp_path / "one"), "--model", str(folder / "a")], "two models are named 'a'"),
        (["--models", str(folder), "--pin", "x"], "'x' is not among the models served (a, b, c)"),
        (["--model", str(folder / "a"), "--pin", "a"], "--keep-alive and --pin apply to several models"),
        (["--models", str(folder), "--draft", str(folder / "a")], "serve one model"),
    ]:
        done = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "serve", *flags], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr
    (tmp_path / "one" / "hf").mkdir()
    (tmp_path / "one" / "hf" / "config.json").write_text("{}")
    flags = ["--models", str(tmp_path / "one"), "--pin", "x"]  # refused after the folder is read: the server never starts
    done = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "serve", *flags], capture_output=True, text=True, timeout=60)
    skipped = f"--models: not serving hf: a Hugging Face model folder; `edgeinfer export {tmp_path / 'one' / 'hf'} -o OUT` makes"
    assert skipped in done.stderr and "'x' is not among the models served (a)" in done.stderr


def _rss(process) -> int:
    """The server process's resident memory, in bytes (Linux's /proc)."""
    for line in open(f"/proc/{process.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's resident memory from /proc")
def test_resident_memory_returns_near_its_start_once_every_model_is_unloaded(tmp_path):
    """Two models of 42 MB of fp32 weights each: loading them raises the server's RSS by about their
    size, and once both are unloaded (keep-alive) it comes back to within a quarter of one model."""
    from conftest import build_llama

    from edgeinfer.export import ExportOptions, export_model

    wide = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    for seed, name in enumerate("xy"):
        build_llama(tmp_path / f"hf-{name}", seed=seed, **wide)
        export_model(str(tmp_path / f"hf-{name}"), tmp_path / "models" / name, ExportOptions())
    weights = _planned_bytes(tmp_path / "models" / "x", {"max_batch": 2})
    process, url = _start("--models", str(tmp_path / "models"), "--keep-alive", "3", "--prefix-cache", "0")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        client.completions.create(model="x", prompt=PROMPT, max_tokens=2)  # the first request's own allocations
        poll(url, lambda: not any(_loaded(url).values()), seconds=30)
        start = _rss(process)
        for name in "xy":
            client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        loaded = _rss(process)
        poll(url, lambda: not any(_loaded(url).values()), seconds=30)
        assert loaded - start > weights  # the two models were in memory
        # a request's last objects (and with them its model) may outlive the unload by a moment
        poll(url, lambda: _rss(process) - start < weights / 4, seconds=10)
    finally:
        _stop(process)


def test_a_replaced_folder_is_served_whole_and_new_and_a_damaged_one_is_a_503_naming_it(folder, tmp_path):
    """--keep-alive 0: each request loads its model afresh from its folder as it is then."""
    from test_serve_tools import tool_export
    from test_tools import HERMES

    for name in "ab":
        linked_copy(folder / name, tmp_path / "models" / name)
    other = tool_export(tmp_path / "other", HERMES)  # other weights, another chat template
    chat = [{"role": "user", "content": "Hi"}]
    process, url = _start("--models", str(tmp_path / "models"), "--keep-alive", "0")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        asked = dict(model="a", messages=chat, max_tokens=8)
        first = client.chat.completions.create(**asked).choices[0].message.content
        assert first == Engine.load(folder / "a", provider="cpu").chat(chat, max_new_tokens=8).text
        poll(url, lambda: not _loaded(url)["a"], seconds=10)
        shutil.rmtree(tmp_path / "models" / "a")
        linked_copy(other, tmp_path / "models" / "a")  # a new export in its place
        replaced = client.chat.completions.create(**asked).choices[0].message.content
        assert replaced == Engine.load(other, provider="cpu").chat(chat, max_new_tokens=8).text != first
        poll(url, lambda: not _loaded(url)["a"], seconds=10)

        template = tmp_path / "models" / "a" / "chat_template.jinja"  # changed in place, the same size
        text = template.read_text()
        template.unlink()  # the linked copy shares the file with `other`: write a new one
        template.write_text(text.replace("user", "USER"))
        for damage, reason in [("template", "does not match the SHA-256"), ("weights", "is missing")]:
            if damage == "weights":
                (tmp_path / "models" / "a" / "model.onnx.data").unlink()
            refused = httpx.post(f"{url}/v1/chat/completions", json=asked)
            error = refused.json()["error"]
            assert refused.status_code == 503 and "the model 'a' is unavailable" in error["message"] and reason in error["message"]
            listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
            assert listed["a"]["available"] is False and reason in listed["a"]["unavailable_reason"]
            assert listed["b"]["available"] is True
            assert client.completions.create(model="b", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
        shutil.rmtree(tmp_path / "models" / "a")
        linked_copy(folder / "a", tmp_path / "models" / "a")  # mended: served again
        assert client.chat.completions.create(**asked).choices[0].message.content == first
        assert {m["id"]: m["available"] for m in httpx.get(f"{url}/v1/models").json()["data"]}["a"] is True
    finally:
        _stop(process)
