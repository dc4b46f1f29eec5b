"""Soak of `edgeinfer serve` under mixed load: streams, whole requests, clients that drop, bad
requests and bursts past the queue (429s), for a bounded time, from client threads on this
machine (loopback only). Prints the requests by status, the largest gap of a stream that runs
throughout, the server's RSS (after warm-up, peak, at the end of the load and after an idle
minute) and its open file descriptors.

    python benchmarks/serve_soak.py [--model DIR|NAME] [--seconds 120] [--idle 60] [--clients 6] [--prefix-cache MIB]
                                    [--json FILE]

Without --model, a tiny random llama is built and exported here (needs the export extra). The
server runs with --max-batch 4 --max-queue 4, so the bursts overflow its queue. The prefix
cache keeps up to its budget of the prompts' blocks (64 MiB by default) and so grows through a
soak of distinct prompts by design: its size is printed, and `--prefix-cache 0` leaves it out of
the RSS figures. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import tiny_export  # noqa: E402 - the SDK soak's tiny model

BAD = [  # (path, raw body): each answered with a 4xx
    ("/v1/completions", b'{"model": "MODEL", "prompt": "a\\ud800b"}'),
    ("/v1/completions", b'{"model": "MODEL", "prompt": '),
    ("/v1/completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": true}'),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": [{"role": "wizard", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "temperature": -1}'),
    (
        "/v1/chat/completions",
        b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "response_format": '
        b'{"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": '
        b'{"a": {"$ref": "#"}}, "required": ["a"]}}}}',
    ),
    ("/v1/nothing", b"{}"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS: the soak reads /proc on Linux")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    """The client threads and what they saw."""

    def __init__(self, url: str, model: str, until: float):
        self.url, self.model, self.until = url, model, until
        self.statuses, self.lock = Counter(), threading.Lock()

    def count(self, status) -> None:
        with self.lock:
            self.statuses[status] += 1

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < self.until:
                kind = rng.choice(["stream", "whole", "drop_stream", "drop_whole", "bad", "burst"])
                try:
                    getattr(self, kind)(http, rng)
                except httpx.HTTPError as e:
                    self.count(type(e).__name__)

    def _body(self, rng, **more) -> dict:
        return {
            "model": self.model,
            "prompt": [rng.randrange(3, 300) for _ in range(rng.choice([3, 40, 150]))],
            "max_tokens": rng.choice([8, 32, 64]),
            "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(1000),
            **more,
        }

    def stream(self, http, rng) -> None:
        with http.stream("POST", f"{self.url}/v1/completions", json=self._body(rng, stream=True)) as response:
            for _ in response.iter_lines():
                pass
            self.count(response.status_code)

    def whole(self, http, rng) -> None:
        self.count(http.post(f"{self.url}/v1/completions", json=self._body(rng, n=rng.choice([1, 2]))).status_code)

    def drop_stream(self, http, rng) -> None:
        with http.stream("POST", f"{self.url}/v1/completions", json=self._body(rng, stream=True, max_tokens=200)) as response:
            lines = response.iter_lines()
            next(lines, None)
            next(lines, None)
            self.count(f"dropped stream ({response.status_code})")

    def drop_whole(self, http, rng) -> None:
        try:
            httpx.post(f"{self.url}/v1/completions", json=self._body(rng, max_tokens=200), timeout=0.2)
        except httpx.TimeoutException:
            self.count("dropped whole")

    def bad(self, http, rng) -> None:
        path, body = rng.choice(BAD)
        self.count(
            http.post(
                f"{self.url}{path}", content=body.replace(b"MODEL", self.model.encode()), headers={"content-type": "application/json"}
            ).status_code
        )

    def burst(self, http, rng) -> None:
        """Twelve requests at once: past the batch and the queue."""
        threads = [
            threading.Thread(
                target=lambda: self.count(httpx.post(f"{self.url}/v1/completions", json=self._body(rng), timeout=60).status_code)
            )
            for _ in range(12)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def watch_stream(url: str, model: str, until: float) -> list[float]:
    """One long stream after another until `until`: the gaps between two of a stream's chunks. It
    runs in a process of its own, so that the load's client threads do not hold its GIL."""
    gaps, body = [], {"model": model, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < until:
            with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                last = None
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
    return gaps


def serve(*flags: str) -> tuple[subprocess.Popen, str]:
    """`edgeinfer serve FLAGS` on a free port of 127.0.0.1 (CPU provider, its log dropped), once
    /health says 200 (at most 120 s), and its URL."""
    port = free_port()
    command = [sys.executable, "-m", "edgeinfer.cli", "serve", *flags, "--port", str(port), "--provider", "cpu"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while not _healthy(url):
        if time.monotonic() > deadline or server.poll() is not None:
            server.kill()
            raise RuntimeError("the server did not become healthy")
        time.sleep(0.2)
    return server, url


def under_load(pid: int, url: str, model: str, began: float, seconds: float, client, clients: int) -> tuple[list, float | None, float]:
    """`clients` threads of `client(seed)` running until `seconds` after `began`, while a forked
    process watches one stream of `model` after another: (that stream's gaps, the server's RSS
    after the first tenth of the time, its peak RSS)."""
    watcher = multiprocessing.get_context("fork").Pool(1)  # forked before the client threads start
    watched = watcher.apply_async(watch_stream, (url, model, began + seconds))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    warm_rss, peak = None, 0.0
    while any(thread.is_alive() for thread in threads):
        peak = max(peak, rss_mib(pid))
        if warm_rss is None and time.monotonic() > began + seconds / 10:
            warm_rss = rss_mib(pid)
        time.sleep(0.5)
    gaps = watched.get(max(120, seconds / 2))
    watcher.close()
    return gaps, warm_rss, peak


def soak(export: Path, seconds: float, idle: float, clients: int, prefix_cache: int | None) -> dict:
    cache = [] if prefix_cache is None else ["--prefix-cache", str(prefix_cache)]
    server, url = serve("--model", str(export), "--max-batch", "4", "--max-queue", "4", *cache)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        start_rss, start_fds = rss_mib(server.pid), open_fds(server.pid)
        began = time.monotonic()
        load = Load(url, model, began + seconds)
        gaps, warm_rss, peak = under_load(server.pid, url, model, began, seconds, load.client, clients)
        end_rss, end_fds = rss_mib(server.pid), open_fds(server.pid)
        time.sleep(idle)
        idle_rss, idle_fds = rss_mib(server.pid), open_fds(server.pid)
        healthy = _healthy(url)
        cached = _metric(url, "edgeinfer_prefix_cache_bytes")
    finally:
        server.terminate()
        server.wait(60)
    return {
        "seconds": round(time.monotonic() - began - idle, 1),
        "requests_by_status": dict(sorted((str(k), v) for k, v in load.statuses.items())),
        "server_errors": sum(v for k, v in load.statuses.items() if isinstance(k, int) and k >= 500),
        "largest_stream_gap_s": round(max(gaps), 3),
        "stream_gaps_over_0.2_s": sum(g > 0.2 for g in gaps),
        "stream_chunks": len(gaps) + 1,
        "p99_stream_gap_s": round(sorted(gaps)[int(len(gaps) * 0.99)], 4),
        "rss_start_mib": round(start_rss, 1),
        "rss_after_warm_up_mib": round(warm_rss or end_rss, 1),
        "rss_peak_mib": round(peak, 1),
        "rss_end_of_load_mib": round(end_rss, 1),
        f"rss_after_{idle:g}_s_idle_mib": round(idle_rss, 1),
        "idle_against_warm_up_pct": round(100 * (idle_rss / (warm_rss or end_rss) - 1), 2),
        "prefix_cache_mib": round(cached / 2**20, 1),
        "fds_start": start_fds,
        "fds_end_of_load": end_fds,
        "fds_after_idle": idle_fds,
        "healthy_after": healthy,
    }


def _metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="export folder or catalog name [default: a tiny random llama]")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--idle", type=float, default=60)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--prefix-cache", type=int, default=None, metavar="MIB", help="the server's --prefix-cache [default: its own]")
    parser.add_argument("--json", default="serve_soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        if args.model is None:
            export = tiny_export(Path(folder))
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from edgeinfer.cli.resolve import resolve_export

            export = resolve_export(args.model, lambda message: print(message, file=sys.stderr))
        report(soak(export, args.seconds, args.idle, args.clients, args.prefix_cache), args.json)


def report(figures: dict, path: str) -> None:
    """Print the figures a line each, and write them to `path` as JSON."""
    for name, value in figures.items():
        print(f"{name}: {value}")
    Path(path).write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures written to {path}")


if __name__ == "__main__":
    main()
