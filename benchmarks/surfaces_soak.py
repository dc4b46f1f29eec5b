"""Soak of `edgeinfer serve`'s five APIs together, for a bounded time, from client threads on this
machine (loopback only): chat completions with tools (required and auto, whole and streamed),
Responses with store (chains continued through previous_response_id, read back, deleted),
Anthropic's Messages, embeddings, a second chat model and an embedding model churning through the
pool's memory limit, and a LoRA adapter (`chat:ad`). Prints the requests by route and status, the
5xx count, the largest gap of a stream watched throughout (a pinned model), and the server's RSS at
start, after warm-up, at its peak, at the end of the load and after an idle spell, with the
Responses store's size.

    python benchmarks/surfaces_soak.py [--seconds 600] [--idle 60] [--clients 6] [--json FILE]

The models are tiny random ones built here from the tests' helpers (tests/conftest.py and
friends; needs the export and test extras): `chat` (a tool-calling template and a rank-8 adapter,
pinned), `other` (another llama) and `embed` (an embedding model); the memory limit holds `chat`
and one of the other two, so each request for the third unloads one. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
from serve_soak import _healthy, _metric, open_fds, report, rss_mib, serve, under_load  # noqa: E402

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def build_models(root: Path) -> Path:
    """`root/models/{chat,other,embed}`, the tiny exports the soak serves."""
    from conftest import build_llama
    from test_adapters import ALL, make_adapter
    from test_embeddings import sentence_transformers_config
    from test_serve_tools import tool_export
    from test_tools import HERMES

    from edgeinfer.export import ExportOptions, export_model

    tool_export(root / "chat", HERMES)  # its HF folder, with the template, is the chat model's source
    make_adapter(root / "chat" / "hf", root / "ad", ALL, 8, 1)
    export_model(str(root / "chat" / "hf"), root / "models" / "chat", ExportOptions(adapters=(("ad", str(root / "ad")),)))
    wide = dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4
    )  # MiBs, so the limit tells them apart
    build_llama(root / "other-hf", seed=3, context=2048, **wide)
    export_model(str(root / "other-hf"), root / "models" / "other", ExportOptions())
    build_llama(root / "embed-hf", seed=4, **wide)
    sentence_transformers_config(root / "embed-hf", "mean", True)
    export_model(str(root / "embed-hf"), root / "models" / "embed", ExportOptions(task="embedding"))
    return root / "models"


class Load:
    """The client threads and what they saw, by route and status."""

    def __init__(self, url: str, until: float, tools: list[dict]):
        self.url, self.until, self.tools = url, until, tools
        self.statuses, self.lock, self.stored = Counter(), threading.Lock(), []

    def count(self, kind: str, status) -> None:
        with self.lock:
            self.statuses[(kind, status)] += 1

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds = ["chat_tools", "chat_stream", "responses", "messages", "embeddings", "other", "adapter", "drop"]
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < self.until:
                kind = rng.choice(kinds)
                try:
                    getattr(self, kind)(http, rng)
                except httpx.HTTPError as e:
                    self.count(kind, type(e).__name__)

    def _post(self, http, kind: str, path: str, body: dict) -> httpx.Response:
        response = http.post(f"{self.url}{path}", json=body)
        self.count(kind, response.status_code)
        return response

    def chat_tools(self, http, rng) -> None:
        body = {
            "model": "chat",
            "messages": ASK,
            "tools": self.tools,
            "tool_choice": rng.choice(["required", "auto"]),
            "max_tokens": 96,
        }
        self._post(http, "chat_tools", "/v1/chat/completions", {**body, "temperature": 0.8, "seed": rng.randrange(1000)})

    def chat_stream(self, http, rng) -> None:
        body = {"model": "chat", "messages": ASK, "tools": self.tools, "stream": True, "max_tokens": 64}
        with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            for _ in response.iter_lines():
                pass
            self.count("chat_stream", response.status_code)

    def responses(self, http, rng) -> None:
        with self.lock:
            previous = rng.choice(self.stored) if self.stored and rng.random() < 0.6 else None
        body = {"model": "chat", "input": "Tell me more " * rng.randrange(1, 20), "max_output_tokens": 16, "store": True}
        response = self._post(http, "responses", "/v1/responses", {**body, "previous_response_id": previous})
        if response.status_code == 200:
            made = response.json()["id"]
            with self.lock:
                self.stored = [*self.stored[-63:], made]
            if rng.random() < 0.1:
                self.count("responses_get", http.get(f"{self.url}/v1/responses/{made}").status_code)
            if rng.random() < 0.05:
                with self.lock:
                    self.stored.remove(made)
                self.count("responses_delete", http.delete(f"{self.url}/v1/responses/{made}").status_code)

    def messages(self, http, rng) -> None:
        body = {"model": "chat", "max_tokens": 24, "messages": ASK, "stream": rng.random() < 0.5}
        self._post(http, "messages", "/v1/messages", body)

    def embeddings(self, http, rng) -> None:
        texts = ["edge boxes " * rng.randrange(1, 30) for _ in range(rng.choice([1, 8, 64]))]
        self._post(http, "embeddings", "/v1/embeddings", {"model": "embed", "input": texts})

    def other(self, http, rng) -> None:
        body = {"model": "other", "prompt": [rng.randrange(3, 300) for _ in range(40)], "max_tokens": 24}
        self._post(http, "other", "/v1/completions", body)

    def adapter(self, http, rng) -> None:
        self._post(http, "adapter", "/v1/chat/completions", {"model": "chat:ad", "messages": ASK, "max_tokens": 24})

    def drop(self, http, rng) -> None:
        body = {"model": rng.choice(["chat", "chat:ad"]), "messages": ASK, "max_tokens": 200, "stream": True}
        with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
            next(response.iter_lines(), None)
            self.count("drop", f"dropped ({response.status_code})")


def soak(models: Path, seconds: float, idle: float, clients: int) -> dict:
    from test_tools import TOOLS

    limit = _limit_mib(models)
    flags = ["--models", str(models), "--pin", "chat", "--memory-limit", str(limit), "--keep-alive", "30", "--max-batch", "4"]
    server, url = serve(*flags)
    try:
        start_rss, start_fds = rss_mib(server.pid), open_fds(server.pid)
        began = time.monotonic()
        load = Load(url, began + seconds, TOOLS)
        gaps, warm_rss, peak = under_load(server.pid, url, "chat", began, seconds, load.client, clients)
        end_rss, stored = rss_mib(server.pid), _metric(url, "edgeinfer_responses_stored_bytes")
        time.sleep(idle)
        idle_rss, idle_fds = rss_mib(server.pid), open_fds(server.pid)
        figures = {
            name: _metric(url, f"edgeinfer_{name}") for name in ("model_loads_total", "model_unloads_total", "responses_stored")
        }
        healthy = _healthy(url)
    finally:
        server.terminate()
        server.wait(60)
    by_status = Counter()
    for (_, status), count in load.statuses.items():
        by_status[status] += count
    return {
        "seconds": round(seconds, 1),
        "memory_limit_mib": limit,
        "requests_by_route_and_status": {f"{k} {s}": v for (k, s), v in sorted(load.statuses.items(), key=str)},
        "requests_by_status": dict(sorted((str(k), v) for k, v in by_status.items())),
        "server_errors": sum(v for k, v in by_status.items() if isinstance(k, int) and k >= 500),
        "model_loads": figures["model_loads_total"],
        "model_unloads": figures["model_unloads_total"],
        "largest_stream_gap_s": round(max(gaps), 3),
        "p99_stream_gap_s": round(sorted(gaps)[int(len(gaps) * 0.99)], 4),
        "stream_chunks": len(gaps) + 1,
        "rss_start_mib": round(start_rss, 1),
        "rss_after_warm_up_mib": round(warm_rss or end_rss, 1),
        "rss_peak_mib": round(peak, 1),
        "rss_end_of_load_mib": round(end_rss, 1),
        f"rss_after_{idle:g}_s_idle_mib": round(idle_rss, 1),
        "idle_against_warm_up_pct": round(100 * (idle_rss / (warm_rss or end_rss) - 1), 2),
        "responses_stored_at_end": figures["responses_stored"],
        "responses_store_mib_at_end_of_load": round(stored / 2**20, 2),
        "fds_start": start_fds,
        "fds_after_idle": idle_fds,
        "healthy_after": healthy,
    }


def _limit_mib(models: Path) -> int:
    """MiB that hold `chat` and the larger of the other two, not all three."""
    from edgeinfer.sdk.pool import _planned_bytes

    sizes = {name: _planned_bytes(models / name, {"max_batch": 4}) for name in ("chat", "other", "embed")}
    mib = -(-(sizes["chat"] + max(sizes["other"], sizes["embed"])) // 2**20)
    if mib * 2**20 >= sum(sizes.values()):
        raise RuntimeError(f"a limit in whole MiB cannot hold two of the models and not three: {sizes}")
    return mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--idle", type=float, default=60)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--json", default="surfaces_soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        report(soak(build_models(Path(folder)), args.seconds, args.idle, args.clients), args.json)


if __name__ == "__main__":
    main()
