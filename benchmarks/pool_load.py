"""What loading a model on request costs, through a real `edgeinfer serve --models` server: the
first request's time to first token on a model that is not loaded against one that is, the load
time the server reports, and another model's decode rate while the load runs against without.

    python benchmarks/pool_load.py EXPORT [--rounds 5] [--new-tokens 128]

EXPORT is served twice (hard-linked copies `a` and `b`), `a` pinned and `b` unloaded as soon as it
is idle (`--keep-alive 0`), so every round loads `b` again. Each round: a request to `b` (loaded by
it: its TTFT, and the load seconds /metrics adds), a request to `a` (loaded: its TTFT), then a
stream of `--new-tokens` on `a`, alone and again with `b`'s request sent a quarter of the way in
(the rate of the tokens that came while `b` loaded and answered). Medians over the rounds. Figures
are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Write a short story about an edge box that serves language models to its users."


def serve(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "edgeinfer.cli", "serve", "--models", str(folder), "--pin", "a", "--keep-alive", "0"]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--provider", "cpu", "--max-batch", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    import httpx

    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not start")


def first_token(client, model: str) -> float:
    """Seconds from sending a streamed request to its first token."""
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    elapsed = time.perf_counter() - start
    for _ in stream:
        pass
    return elapsed


def stream_rate(client, new_tokens: int, during=None) -> float:
    """Decode tok/s of a stream on `a` after its first token; `during()` runs on another thread once
    a quarter of the tokens have come, and the rate is that of the tokens from then to the end of `during`."""
    times, fired, done = [], threading.Event(), threading.Event()

    def side():
        fired.wait()
        during()
        times.append(("done", time.perf_counter()))
        done.set()

    if during is not None:
        threading.Thread(target=side, daemon=True).start()
    stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=new_tokens, stream=True, extra_body={"ignore_eos": True})
    stamps = []
    for chunk in stream:
        stamps.append(time.perf_counter())
        if len(stamps) == new_tokens // 4:
            fired.set()
    if during is None:
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])
    done.wait()
    start, end = stamps[new_tokens // 4 - 1], next(t for kind, t in times if kind == "done")
    inside = [t for t in stamps if start < t <= end]
    return len(inside) / (min(end, stamps[-1]) - start)


def metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    import openai

    with tempfile.TemporaryDirectory(dir=args.export.parent) as scratch:
        folder = Path(scratch)
        for name in "ab":
            shutil.copytree(args.export, folder / name, copy_function=lambda s, t: os.link(s, t))
        process, url = serve(folder)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            first_token(client, "a")  # warm-up
            rows = []
            for _ in range(args.rounds):
                loads_before = metric(url, "edgeinfer_model_load_seconds_total")
                cold = first_token(client, "b")
                load = metric(url, "edgeinfer_model_load_seconds_total") - loads_before
                time.sleep(0.5)  # b unloads (keep-alive 0)
                warm_a = first_token(client, "a")
                alone = stream_rate(client, args.new_tokens)
                time.sleep(0.5)
                beside = stream_rate(client, args.new_tokens, during=lambda: first_token(client, "b"))
                rows.append({"cold": cold, "load": load, "warm": warm_a, "alone": alone, "beside": beside})
                time.sleep(0.5)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    print(f"{args.export}: {args.rounds} rounds, medians")
    print("| | seconds or tok/s |")
    print("|---|---:|")
    print(f"| TTFT, model not loaded (its load included) | {median['cold']:.3f} s |")
    print(f"| its load, as /metrics reports it | {median['load']:.3f} s |")
    print(f"| TTFT, model loaded | {median['warm']:.3f} s |")
    print(f"| TTFT beyond the load: cold - load - warm | {median['cold'] - median['load'] - median['warm']:+.3f} s |")
    print(f"| another model's stream, alone | {median['alone']:.1f} tok/s |")
    print(f"| the same while the model loads | {median['beside']:.1f} tok/s ({median['beside'] / median['alone']:.0%}) |")


if __name__ == "__main__":
    main()
