"""Prometheus metrics of one edge server, on a registry of its own (no globals).

Same names as the cloud runtime (from ``hybridllm_common.metrics``), plus the response
cache's hit/miss counters and entry gauge.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridllm_common import metrics as names
from hybridllm_edge import engine

STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def _counter(name: str, doc: str, r: CollectorRegistry, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name.removesuffix("_total"), doc, list(labels), registry=r)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        b = names.LATENCY_BUCKETS
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first token", buckets=b, registry=r
        )
        self.tbt = Histogram(
            names.TIME_PER_OUTPUT_TOKEN_SECONDS, "Time between output tokens", buckets=b, registry=r
        )
        self.e2e = Histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "End-to-end request latency", buckets=b, registry=r
        )
        self.prompt_tokens = _counter(names.PROMPT_TOKENS_TOTAL, "Prompt tokens", r)
        self.generation_tokens = _counter(names.GENERATION_TOKENS_TOTAL, "Generated tokens", r)
        self.requests = _counter(names.REQUESTS_TOTAL, "Finished requests", r, ("finish_reason",))
        self.rejected = _counter(names.REQUESTS_REJECTED_TOTAL, "Rejected requests", r, ("code",))
        self.structured = _counter(
            names.STRUCTURED_REQUESTS_TOTAL,
            "Requests decoded under a grammar (structured output, tool calls)",
            r,
            ("kind",),
        )
        self.cache_hits = _counter(names.RESPONSE_CACHE_HITS_TOTAL, "Response cache hits", r)
        self.cache_misses = _counter(
            names.RESPONSE_CACHE_MISSES_TOTAL,
            "Cacheable requests not found in the response cache",
            r,
        )
        self.cache_entries = Gauge(
            names.RESPONSE_CACHE_ENTRIES, "Response cache entries", registry=r
        )
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "Requests running", registry=r)
        self.waiting = Gauge(
            names.NUM_REQUESTS_WAITING, "Requests waiting (queue depth)", registry=r
        )
        self.batch_size = Histogram(
            names.BATCH_SIZE, "Sequences per engine step", buckets=STEP_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            names.TOKENS_PER_STEP, "Tokens per engine step", buckets=STEP_BUCKETS, registry=r
        )

    def on_step(self, stats: engine.EngineStats) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.batch_size.observe(stats.last_batch_size)
        self.step_tokens.observe(stats.last_num_tokens)
