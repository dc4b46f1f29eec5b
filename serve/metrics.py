"""`GET /metrics`: Prometheus text, from the server's own registry (none of the process-wide state
prometheus_client keeps by default)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("edgeinfer_requests", "HTTP requests by path and status", ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter("edgeinfer_prompt_tokens", "Prompt tokens of finished generations", registry=self.registry)
        self.generated_tokens = Counter("edgeinfer_generated_tokens", "Tokens generated", registry=self.registry)
        self.cancelled = Counter("edgeinfer_cancelled_requests", "Streams whose client went away before the end", registry=self.registry)
        self.queue = Gauge("edgeinfer_queue_length", "Requests waiting for a row", registry=self.registry)
        self.running = Gauge("edgeinfer_running_rows", "Requests in the running batch", registry=self.registry)
        self.ttft = Histogram("edgeinfer_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=self.registry)
        self.prefix_hits = Gauge("edgeinfer_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache", registry=self.registry)
        self.prefix_misses = Gauge("edgeinfer_prefix_cache_miss_tokens", "Prompt tokens prefilled", registry=self.registry)
        self.prefix_bytes = Gauge("edgeinfer_prefix_cache_bytes", "Bytes the prefix cache holds", registry=self.registry)
        self.inter_token = Histogram("edgeinfer_inter_token_latency_seconds", "Mean time between tokens, per generation",
                                     buckets=_LATENCY, registry=self.registry)

    def finished(self, prompt_tokens: int, generated: int, ttft_s: float, tokens_per_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated)
        self.ttft.observe(ttft_s)
        if tokens_per_s > 0:
            self.inter_token.observe(1 / tokens_per_s)

    def render(self, scheduler) -> bytes:
        if scheduler is not None:
            self.queue.set(scheduler.waiting)
            self.running.set(scheduler.running)
            cache = scheduler.engine.prefix_cache
            self.prefix_hits.set(cache.hits)
            self.prefix_misses.set(cache.misses)
            self.prefix_bytes.set(cache.held)
        return generate_latest(self.registry)
