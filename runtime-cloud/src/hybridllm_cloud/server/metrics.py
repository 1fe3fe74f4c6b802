"""Prometheus metrics of one cloud server instance, on a registry of its own (no globals).

The families both runtimes export are ``hybridllm_common.serving.metrics.ServerMetrics``;
this adds the engine's own: KV cache and prefix cache, preemptions and step failures,
disaggregation, speculative decoding and verifier-guided search.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridllm_cloud.disagg import connector
from hybridllm_cloud.engine import llm_engine
from hybridllm_common import metrics as names
from hybridllm_common.serving import metrics as serving_metrics

# Speculative decoding (vLLM's spec_decode counters). Registered only by a server that
# speculates (``enable_speculative``): the acceptance rate is
# rate(accepted_tokens) / rate(draft_tokens), and tokens per verification
# 1 + rate(accepted_tokens) / rate(drafts).
SPEC_DECODE_NUM_DRAFTS_TOTAL = "hybridllm_spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL = "hybridllm_spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL = "hybridllm_spec_decode_num_accepted_tokens_total"

# Verifier-guided search: the verifier's share of the compute is
# rate(..._computed_tokens_total{model="verifier"}) / rate(..._computed_tokens_total).
SEARCH_REQUESTS_TOTAL = "hybridllm_search_requests_total"
SEARCH_COMPUTED_TOKENS_TOTAL = "hybridllm_search_computed_tokens_total"


class _Totals(Collector):
    """Counters whose value the engine keeps (cumulative since start): each is read at
    scrape time from a function, or from the last value set."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._docs: dict[str, str] = {}
        self._values: dict[str, float] = {}
        self._reads: dict[str, Callable[[], float]] = {}
        registry.register(self)

    def add(self, name: str, doc: str) -> None:
        self._docs[name] = doc

    def set(self, name: str, value: float) -> None:
        self._values[name] = value

    def read(self, name: str, fn: Callable[[], float]) -> None:
        self._reads[name] = fn

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        for name, doc in self._docs.items():
            read = self._reads.get(name)
            value = read() if read is not None else self._values.get(name, 0.0)
            yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


class ServerMetrics(serving_metrics.ServerMetrics):
    def __init__(self) -> None:
        super().__init__("Requests per engine step")
        r, b = self.registry, names.LATENCY_BUCKETS
        self.blocks_used = Gauge(names.KV_BLOCKS_USED, "KV blocks in use", registry=r)
        self.blocks_free = Gauge(names.KV_BLOCKS_FREE, "KV blocks free", registry=r)
        self.hit_rate = Gauge(
            names.PREFIX_CACHE_HIT_RATE, "Prefix cache hit rate (tokens)", registry=r
        )
        # Counts the engine keeps itself (since start), exported as counters at each scrape.
        self.totals = _Totals(r)
        self.totals.add(
            names.PREEMPTIONS_TOTAL, "Preemptions (requests swapped out of the KV cache)"
        )
        self.totals.add(names.ENGINE_STEP_FAILURES_TOTAL, "Engine steps that raised")
        self.totals.add(
            names.ENGINE_REQUESTS_FAILED_TOTAL,
            "Requests the engine failed after isolating a failed step",
        )

        # Disaggregation (both roles; zero in the monolithic one).
        self.kv_bytes = serving_metrics.counter(
            names.KV_TRANSFER_BYTES_TOTAL,
            "KV cache bytes moved between prefill and decode workers",
            r,
            ("direction",),
        )
        self.kv_seconds = Histogram(
            names.KV_TRANSFER_SECONDS,
            "KV transfer duration (request sent to last block received / DONE sent)",
            ["outcome"],
            buckets=b,
            registry=r,
        )
        self.kv_streaming = Histogram(
            names.KV_TRANSFER_STREAMING_SECONDS,
            "Decode side: first to last KV frame of a transfer (overlaps prefill compute)",
            buckets=b,
            registry=r,
        )
        self.prefills = serving_metrics.counter(
            names.REMOTE_PREFILLS_TOTAL,
            "Prefills by where they ran (decode role) and outcome",
            r,
            ("where", "outcome"),
        )
        self.transfers_active = Gauge(
            names.KV_TRANSFERS_ACTIVE, "KV transfers in progress", ["role"], registry=r
        )
        self.role_info = Gauge(names.ENGINE_ROLE_INFO, "Role of this engine", ["role"], registry=r)
        # Verifier-guided search (/v1/search).
        self.searches = serving_metrics.counter(
            SEARCH_REQUESTS_TOTAL, "Verifier-guided searches answered", r
        )
        self.search_tokens = serving_metrics.counter(
            SEARCH_COMPUTED_TOKENS_TOTAL,
            "Tokens computed for answered searches (uncached prompt plus generated), by model",
            r,
            ("model",),
        )
        self._local_prefills = 0
        self._speculative = False

    def enable_speculative(self) -> None:
        """Adds the speculative decoding counters (a server without speculation has none)."""
        self._speculative = True
        self.totals.add(
            SPEC_DECODE_NUM_DRAFTS_TOTAL,
            "Speculative verifications (requests x steps with proposals)",
        )
        self.totals.add(
            SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, "Proposed tokens verified by the target"
        )
        self.totals.add(
            SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, "Proposed tokens the target accepted"
        )

    def set_role(self, role: str, active: Callable[[], float] | None = None) -> None:
        self.role_info.labels(role=role).set(1)
        if active is not None:
            self.transfers_active.labels(role=role).set_function(active)

    def on_kv_transfer(self, stats: connector.TransferStats) -> None:
        """Decode role: one remote prefill ended (connector thread)."""
        self.kv_bytes.labels(direction="received").inc(stats.bytes)
        self.kv_seconds.labels(outcome=stats.outcome).observe(stats.seconds)
        if stats.first_frame_s is not None and stats.last_frame_s is not None:
            self.kv_streaming.observe(stats.last_frame_s - stats.first_frame_s)
        self.prefills.labels(where="remote", outcome=stats.outcome).inc()

    def on_kv_served(self, outcome: str, seconds: float, sent: int) -> None:
        """Prefill role: one transfer to a decode worker ended."""
        self.kv_bytes.labels(direction="sent").inc(sent)
        self.kv_seconds.labels(outcome=outcome).observe(seconds)

    def watch_failures(self, engine: Any) -> None:
        """Read the AsyncEngine's failure counters at every scrape."""
        self.totals.read(names.ENGINE_STEP_FAILURES_TOTAL, lambda: engine.num_step_failures)
        self.totals.read(names.ENGINE_REQUESTS_FAILED_TOTAL, lambda: engine.num_requests_failed)

    def on_step(self, stats: llm_engine.EngineStats) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        super().on_step(stats)
        self.blocks_used.set(stats.num_kv_blocks_used)
        self.blocks_free.set(stats.num_kv_blocks_free)
        self.hit_rate.set(stats.prefix_hit_rate)
        self.totals.set(names.PREEMPTIONS_TOTAL, stats.num_preemptions)
        if self._speculative:
            self.totals.set(SPEC_DECODE_NUM_DRAFTS_TOTAL, stats.num_spec_drafts)
            self.totals.set(SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL, stats.num_spec_draft_tokens)
            self.totals.set(SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL, stats.num_spec_accepted_tokens)
        if stats.num_local_prefills > self._local_prefills:
            self.prefills.labels(where="local", outcome="ok").inc(
                stats.num_local_prefills - self._local_prefills
            )
            self._local_prefills = stats.num_local_prefills
