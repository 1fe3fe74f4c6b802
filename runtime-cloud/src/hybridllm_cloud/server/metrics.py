"""Prometheus metrics of one server instance, on a registry of its own (no globals)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridllm_cloud.disagg import connector
from hybridllm_cloud.engine import llm_engine
from hybridllm_common import metrics as names

STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, b = self.registry, names.LATENCY_BUCKETS
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first token", buckets=b, registry=r
        )
        self.tbt = Histogram(
            names.TIME_PER_OUTPUT_TOKEN_SECONDS, "Time between output tokens", buckets=b, registry=r
        )
        self.e2e = Histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "End-to-end request latency", buckets=b, registry=r
        )
        self.prompt_tokens = Counter(
            names.PROMPT_TOKENS_TOTAL.removesuffix("_total"), "Prompt tokens", registry=r
        )
        self.generation_tokens = Counter(
            names.GENERATION_TOKENS_TOTAL.removesuffix("_total"), "Generated tokens", registry=r
        )
        self.requests = Counter(
            names.REQUESTS_TOTAL.removesuffix("_total"),
            "Finished requests",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            names.REQUESTS_REJECTED_TOTAL.removesuffix("_total"),
            "Rejected requests",
            ["code"],
            registry=r,
        )
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "Requests running", registry=r)
        self.waiting = Gauge(
            names.NUM_REQUESTS_WAITING, "Requests waiting (queue depth)", registry=r
        )
        self.blocks_used = Gauge(names.KV_BLOCKS_USED, "KV blocks in use", registry=r)
        self.blocks_free = Gauge(names.KV_BLOCKS_FREE, "KV blocks free", registry=r)
        self.hit_rate = Gauge(
            names.PREFIX_CACHE_HIT_RATE, "Prefix cache hit rate (tokens)", registry=r
        )
        self.preemptions = Gauge(names.PREEMPTIONS_TOTAL, "Preemptions so far", registry=r)
        self.step_failures = Gauge(
            names.ENGINE_STEP_FAILURES_TOTAL, "Engine steps that raised, so far", registry=r
        )
        self.requests_failed = Gauge(
            names.ENGINE_REQUESTS_FAILED_TOTAL,
            "Requests the engine failed after isolating a failed step, so far",
            registry=r,
        )
        self.batch_size = Histogram(
            names.BATCH_SIZE, "Requests per engine step", buckets=STEP_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            names.TOKENS_PER_STEP, "Tokens per engine step", buckets=STEP_BUCKETS, registry=r
        )

        # Disaggregation (both roles; zero in the monolithic one).
        self.kv_bytes = Counter(
            names.KV_TRANSFER_BYTES_TOTAL.removesuffix("_total"),
            "KV cache bytes moved between prefill and decode workers",
            ["direction"],
            registry=r,
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
        self.prefills = Counter(
            names.REMOTE_PREFILLS_TOTAL.removesuffix("_total"),
            "Prefills by where they ran (decode role) and outcome",
            ["where", "outcome"],
            registry=r,
        )
        self.transfers_active = Gauge(
            names.KV_TRANSFERS_ACTIVE, "KV transfers in progress", ["role"], registry=r
        )
        self.role_info = Gauge(names.ENGINE_ROLE_INFO, "Role of this engine", ["role"], registry=r)
        self._local_prefills = 0

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
        self.step_failures.set_function(lambda: engine.num_step_failures)
        self.requests_failed.set_function(lambda: engine.num_requests_failed)

    def on_step(self, stats: llm_engine.EngineStats) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_used.set(stats.num_kv_blocks_used)
        self.blocks_free.set(stats.num_kv_blocks_free)
        self.hit_rate.set(stats.prefix_hit_rate)
        self.preemptions.set(stats.num_preemptions)
        self.batch_size.observe(stats.last_batch_size)
        self.step_tokens.observe(stats.last_num_tokens)
        if stats.num_local_prefills > self._local_prefills:
            self.prefills.labels(where="local", outcome="ok").inc(
                stats.num_local_prefills - self._local_prefills
            )
            self._local_prefills = stats.num_local_prefills
