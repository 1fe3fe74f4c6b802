"""The gateway's Prometheus metrics, one registry per process (no module-level state).

All names come from ``hybridllm_common.metrics`` (its gateway sections); the aliases
below keep this module's short names. Added latency is the time a request spends in the gateway itself:
from the moment its body is read to the moment the upstream request is sent, plus the
time between the first upstream byte and its write to the client. Its buckets start at
50 microseconds, where the runtimes' latency buckets would show nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridllm_common import metrics as names

ADDED_LATENCY_SECONDS = names.GATEWAY_ADDED_LATENCY_SECONDS
UPSTREAM_ERRORS_TOTAL = names.GATEWAY_UPSTREAM_ERRORS_TOTAL
EJECTIONS_TOTAL = names.GATEWAY_EJECTIONS_TOTAL
RELOADS_TOTAL = names.GATEWAY_CONFIG_RELOADS_TOTAL
OUTSTANDING = names.GATEWAY_OUTSTANDING_REQUESTS
CASCADES_TOTAL = names.GATEWAY_CASCADES_TOTAL

ADDED_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            names.GATEWAY_REQUESTS_TOTAL, "Requests answered, by tier and status code.",
            ["tier", "code"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            names.GATEWAY_ROUTE_DECISIONS_TOTAL, "Routing decisions, by tier and reason.",
            ["tier", "reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first byte of the answer, by tier.",
            ["tier"], buckets=names.LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            names.E2E_REQUEST_LATENCY_SECONDS, "End-to-end request latency, by tier.",
            ["tier"], buckets=names.LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream_latency = Histogram(
            names.GATEWAY_UPSTREAM_LATENCY_SECONDS, "Time until the upstream answered headers.",
            ["tier"], buckets=names.LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.added = Histogram(
            ADDED_LATENCY_SECONDS, "Latency the gateway itself adds to a request.",
            buckets=ADDED_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            UPSTREAM_ERRORS_TOTAL, "Failed upstream attempts, by tier and kind.",
            ["tier", "kind"], registry=r,
        )  # fmt: skip
        self.ejections = Counter(
            EJECTIONS_TOTAL, "Replicas ejected by the circuit breaker.", ["tier"], registry=r
        )
        self.reloads = Counter(RELOADS_TOTAL, "Routing table reloads.", registry=r)
        self.outstanding = Gauge(
            OUTSTANDING, "Requests in flight to each tier.", ["tier"], registry=r
        )
        self.cascades = Counter(CASCADES_TOTAL, "Edge answers re-asked of the cloud.", registry=r)
        self.rejected = Counter(
            names.REQUESTS_REJECTED_TOTAL, "Requests refused by the gateway, by code.",
            ["code"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            names.GATEWAY_PROMPT_TOKENS_TOTAL, "Prompt tokens (estimated) answered, by tier.",
            ["tier"], registry=r,
        )  # fmt: skip
        self.completion_tokens = Counter(
            names.GATEWAY_COMPLETION_TOKENS_TOTAL, "Completion tokens answered, by tier.",
            ["tier"], registry=r,
        )  # fmt: skip

        self.held = Gauge(
            names.GATEWAY_HELD_REQUESTS, "Requests waiting for a replica of a tier at zero.",
            ["tier"], registry=r,
        )  # fmt: skip
        self.cold = Counter(
            names.GATEWAY_COLD_REQUESTS_TOTAL, "Requests that found a tier at zero replicas.",
            ["tier"], registry=r,
        )  # fmt: skip

    def serve_tiers(self, tiers: Iterable[str]) -> None:
        """Export the per-tier demand series at zero from the start: a tier nobody has asked
        yet has no load, which an autoscaler must be able to tell from a missing metric."""
        for tier in tiers:
            self.prompt_tokens.labels(tier=tier)
            self.completion_tokens.labels(tier=tier)
            self.outstanding.labels(tier=tier)
            self.ttft.labels(tier=tier)
            self.held.labels(tier=tier)
            self.cold.labels(tier=tier)
