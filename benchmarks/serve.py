"""Concurrent streaming clients against an OpenAI-compatible server (edgeinfer serve, or llama.cpp's
llama-server): for each number of clients, every client sends the same prompt's token ids in a loop
for a fixed time, streaming, exactly --max-tokens tokens each (ignore_eos). Prints, per level, the
aggregate generated tok/s, the median per-stream tok/s after the first token, and TTFT p50 / p99
(which includes any wait for a free row) over all requests and over the requests after each
client's first: the clients start together, so their first requests arrive as one burst, and the
later ones as the server's steady state lets them. With --server-pid, the server process's CPU use
while idle, after the load (from /proc).

    python benchmarks/serve.py --url http://127.0.0.1:8000/v1 --model NAME [--clients 1,2,4,8,16]
                               [--seconds 20] [--prompt p128] [--max-tokens 64] [--extra JSON] [--json FILE]
                               [--server-pid PID]

Every request sends the same prompt, so a server that caches prompts between requests must be told
not to: `edgeinfer serve --prefix-cache 0`, and for llama-server `--extra '{"cache_prompt": false}'`. A request on a kept-alive connection
that the server had closed is sent again and counted (`retried`).

Raw HTTP (httpx) rather than the openai client, so the client costs the server's 2 cores as little
as possible. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().with_name("prompts.json")


def percentile(values: list[float], share: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(share * len(values)))] if values else float("nan")


def idle_cpu(pid: int, seconds: float) -> float:
    """The share of one core that process `pid` used over `seconds` (user and system time)."""

    def ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    start, began = ticks(), time.perf_counter()
    time.sleep(seconds)
    return (ticks() - start) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - began)


def one_request(http: httpx.Client, url: str, body: dict) -> tuple[float, float, int]:
    """(TTFT s, seconds after the first token, tokens) of one streamed completion."""
    start, first, tokens, pieces = time.perf_counter(), None, None, 0
    with http.stream("POST", f"{url}/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                pieces += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - (first or end), tokens if tokens is not None else pieces


def level(url: str, body: dict, clients: int, seconds: float) -> dict:
    results, retried, stop = [], [], time.perf_counter() + seconds

    def client():
        first = True
        with httpx.Client(timeout=300) as http:
            while time.perf_counter() < stop:
                try:
                    results.append((first, *one_request(http, url, body)))
                    first = False
                except httpx.RemoteProtocolError:  # a kept-alive connection the server closed
                    retried.append(1)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    ttft, later = [r[1] for r in results], [r[1] for r in results if not r[0]]
    return {
        "clients": clients,
        "requests": len(results),
        "retried": len(retried),
        "seconds": elapsed,
        "aggregate_tokens_per_s": sum(r[3] for r in results) / elapsed,
        "stream_tokens_per_s": statistics.median((r[3] - 1) / r[2] for r in results if r[2] > 0),
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttft, 0.99),
        "later_ttft_p50_ms": 1000 * percentile(later, 0.5),
        "later_ttft_p99_ms": 1000 * percentile(later, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--clients", default="1,2,4,8,16")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--prompt", default="p128", help="a prompt of benchmarks/prompts.json")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--extra", default="{}", help="JSON fields added to every request")
    parser.add_argument("--json", dest="json_file", default=None)
    parser.add_argument("--server-pid", type=int, default=None, help="measure this process's CPU use while idle, after the load")
    args = parser.parse_args()
    ids = json.loads(PROMPTS.read_text())["prompts"][args.prompt]
    body = {
        "model": args.model,
        "prompt": ids,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **json.loads(args.extra),
    }
    one_request(httpx.Client(timeout=300), args.url, {**body, "max_tokens": 4})  # warm-up
    figures = []
    print(
        f"{'clients':>7} {'requests':>8} {'retried':>7} {'aggregate tok/s':>15} {'per stream tok/s':>16} {'TTFT p50 ms':>11} "
        f"{'TTFT p99 ms':>11} {'later p50 ms':>12} {'later p99 ms':>12}"
    )
    for clients in (int(c) for c in args.clients.split(",")):
        f = level(args.url, body, clients, args.seconds)
        figures.append(f)
        print(
            f"{f['clients']:>7} {f['requests']:>8} {f['retried']:>7} {f['aggregate_tokens_per_s']:>15.1f} {f['stream_tokens_per_s']:>16.1f} "
            f"{f['ttft_p50_ms']:>11.0f} {f['ttft_p99_ms']:>11.0f} {f['later_ttft_p50_ms']:>12.0f} {f['later_ttft_p99_ms']:>12.0f}",
            flush=True,
        )
    idle = None
    if args.server_pid:
        time.sleep(2)  # streams that the last level's clients left behind end
        idle = idle_cpu(args.server_pid, 10)
        print(f"server idle CPU over 10 s: {100 * idle:.2f}% of one core")
    if args.json_file:
        Path(args.json_file).write_text(
            json.dumps(
                {
                    "url": args.url,
                    "model": args.model,
                    "prompt": args.prompt,
                    "max_tokens": args.max_tokens,
                    "levels": figures,
                    "idle_cpu_share": idle,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
