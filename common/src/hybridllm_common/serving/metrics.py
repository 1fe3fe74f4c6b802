"""The Prometheus metrics both runtimes export, on a registry of each server's own.

Each runtime's ``server/metrics.py`` subclasses :class:`ServerMetrics` and adds its own
families (the cloud's KV cache, disaggregation, speculation and search; the edge's
response cache). The names come from ``hybridllm_common.metrics``; dashboards and alerts
are generated from them (``hybridllm observability generate``), so a family here has the
same name, help and labels on both runtimes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridllm_common import metrics as names

STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def counter(name: str, doc: str, r: CollectorRegistry, labels: tuple[str, ...] = ()) -> Counter:
    """A counter named by its exported name (prometheus_client adds the ``_total``)."""
    return Counter(name.removesuffix("_total"), doc, list(labels), registry=r)


class StepStats(Protocol):
    """What both engines report after every step."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def last_batch_size(self) -> int: ...
    @property
    def last_num_tokens(self) -> int: ...


class Output(Protocol):
    """What both engines emit for a request: its new tokens, and whether it ended."""

    @property
    def new_token_ids(self) -> Sequence[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...


@dataclass
class Timing:
    """The clock of a stream of outputs: when it started, and its last output's time."""

    start: float = field(default_factory=time.monotonic)
    last: float | None = None


class ServerMetrics:
    """``batch_help``: what an engine step batches (the cloud's requests, the edge's
    sequences), the help text of the batch size histogram."""

    def __init__(self, batch_help: str) -> None:
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
        self.prompt_tokens = counter(names.PROMPT_TOKENS_TOTAL, "Prompt tokens", r)
        self.generation_tokens = counter(names.GENERATION_TOKENS_TOTAL, "Generated tokens", r)
        self.requests = counter(names.REQUESTS_TOTAL, "Finished requests", r, ("finish_reason",))
        self.rejected = counter(names.REQUESTS_REJECTED_TOTAL, "Rejected requests", r, ("code",))
        self.structured = counter(
            names.STRUCTURED_REQUESTS_TOTAL,
            "Requests decoded under a grammar (structured output, tool calls)",
            r,
            ("kind",),
        )
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "Requests running", registry=r)
        self.waiting = Gauge(
            names.NUM_REQUESTS_WAITING, "Requests waiting (queue depth)", registry=r
        )
        self.batch_size = Histogram(names.BATCH_SIZE, batch_help, buckets=STEP_BUCKETS, registry=r)
        self.step_tokens = Histogram(
            names.TOKENS_PER_STEP, "Tokens per engine step", buckets=STEP_BUCKETS, registry=r
        )

    def on_step(self, stats: StepStats) -> None:
        """Called from the engine thread after every step (prometheus_client is thread-safe)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.batch_size.observe(stats.last_batch_size)
        self.step_tokens.observe(stats.last_num_tokens)

    def on_output(self, timing: Timing, out: Output) -> None:
        """One output of a request: its time to first token or since the last output,
        its tokens, and, when it ends, its latency and finish reason."""
        now = time.monotonic()
        if timing.last is None:
            self.ttft.observe(now - timing.start)
        else:
            self.tbt.observe(now - timing.last)
        timing.last = now
        self.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self.e2e.observe(now - timing.start)
            self.requests.labels(finish_reason=out.finish_reason or "").inc()
