"""`GET /metrics`: Prometheus text, from the server's own registry (none of the process-wide state
prometheus_client keeps by default)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
GAUGES = {
    "queue_length": "Requests waiting for a row",
    "running_rows": "Requests in the running batch",
    "prefix_cache_hit_tokens": "Prompt tokens taken from the prefix cache",
    "prefix_cache_miss_tokens": "Prompt tokens prefilled",
    "prefix_cache_bytes": "Bytes the prefix cache holds",
    "embedding_requests": "Embedding requests running or waiting",
    "embedding_cancelled": "Embedding requests stopped because their client went away, so far",
    "responses_stored": "Responses API responses stored (store true)",
    "responses_stored_bytes": "Bytes the stored responses hold, as compact JSON",
    "responses_store_evicted": "Stored responses dropped for the count, bytes or TTL bound, so far",
    "responses_store_refused": "Responses not stored for being larger than the whole store, so far",
}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("edgeinfer_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter("edgeinfer_prompt_tokens", "Prompt tokens of finished generations", registry=self.registry)
        self.generated_tokens = Counter("edgeinfer_generated_tokens", "Tokens generated", registry=self.registry)
        self.cancelled = Counter(
            "edgeinfer_cancelled_requests", "Streams whose client went away before the end", registry=self.registry
        )
        self.ttft = Histogram("edgeinfer_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=self.registry)
        self.backend_gauges: dict[str, Gauge] = {}  # made at the first render that has them
        self.inter_token = Histogram(
            "edgeinfer_inter_token_latency_seconds",
            "Mean time between tokens, per generation",
            buckets=_LATENCY,
            registry=self.registry,
        )

    def finished(self, prompt_tokens: int, generated: int, ttft_s: float, tokens_per_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.ttft.observe(ttft_s)
        if tokens_per_s > 0:
            self.inter_token.observe(1 / tokens_per_s)

    def render(self, stats: dict[str, float]) -> bytes:
        """The registry's text, with the backend's `stats` as gauges (a front of Ray replicas has
        none of its own, so it shows none)."""
        for name, value in stats.items():
            if name not in self.backend_gauges:
                self.backend_gauges[name] = Gauge(f"edgeinfer_{name}", GAUGES.get(name, name), registry=self.registry)
            self.backend_gauges[name].set(value)
        return generate_latest(self.registry)
