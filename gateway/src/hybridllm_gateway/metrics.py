"""The gateway's Prometheus metrics, one registry per process (no module-level state).

All names come from ``hybridllm_common.metrics`` (its gateway sections); the aliases
below keep this module's short names. Added latency is the time a request spends in the gateway itself:
from the moment its body is read to the moment the upstream request is sent, plus the
time between the first upstream byte and its write to the client. Its buckets start at
50 microseconds, where the runtimes' latency buckets would show nothing.
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hybridllm_common import metrics as names
from hybridllm_common import speed

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
            names.GATEWAY_REQUESTS_TOTAL, "Requests answered, errors included, by tier (none: "
            "refused before routing) and status code.",
            ["tier", "code"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            names.GATEWAY_ROUTE_DECISIONS_TOTAL, "Routing decisions, by tier and reason.",
            ["tier", "reason"], registry=r,
        )  # fmt: skip
        self.kinds = Counter(
            names.GATEWAY_REQUEST_KINDS_TOTAL, "Routed requests by what they ask for: text, "
            "structured (a response format or vLLM's structured outputs) or tools.",
            ["tier", "kind"], registry=r,
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
            UPSTREAM_ERRORS_TOTAL,
            "Failed upstream attempts, by tier and kind: connect, tls, timeout (no first "
            "byte within the first-byte timeout), read, malformed, empty_stream, mid_stream, "
            "http_<code>, busy (a 503 with Retry-After).",
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
        self.offered = OfferedDemand(
            Counter(
                names.GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL,
                "Prompt tokens (estimated) routed to each tier, counted on arrival.",
                ["tier"], registry=r,
            ),
            Counter(
                names.GATEWAY_OFFERED_COMPLETION_TOKENS_TOTAL,
                "Completion tokens routed to each tier, estimated on arrival from the tier's "
                "recent answers (capped by max_tokens x n).",
                ["tier"], registry=r,
            ),
            Counter(
                names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL,
                "Prompt tokens (estimated) offered to a tier and refused because the tier "
                "was unreachable from this gateway.",
                ["tier"], registry=r,
            ),
            Counter(
                names.GATEWAY_STRANDED_COMPLETION_TOKENS_TOTAL,
                "Completion tokens (estimated as offered ones are) offered to a tier and "
                "refused because the tier was unreachable from this gateway.",
                ["tier"], registry=r,
            ),
        )  # fmt: skip

        self.held = Gauge(
            names.GATEWAY_HELD_REQUESTS, "Requests waiting for a replica of a tier at zero.",
            ["tier"], registry=r,
        )  # fmt: skip
        self.cold = Counter(
            names.GATEWAY_COLD_REQUESTS_TOTAL, "Requests that found a tier at zero replicas.",
            ["tier"], registry=r,
        )  # fmt: skip

        self.revision_attempts = Counter(
            names.GATEWAY_REVISION_ATTEMPTS_TOTAL,
            "Upstream attempts by tier, model revision and result (ok, error).",
            ["tier", "revision", "result"], registry=r,
        )  # fmt: skip
        self.revision_ttft = Histogram(
            names.GATEWAY_REVISION_TTFT_SECONDS,
            "Time to first byte of answered requests, by tier and model revision.",
            ["tier", "revision"], buckets=names.LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.revision_tpot = Histogram(
            names.GATEWAY_REVISION_TPOT_SECONDS,
            "Mean time between output tokens of answers of two or more tokens, by tier and "
            "model revision.",
            ["tier", "revision"], buckets=names.TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.revision_weight = Gauge(
            names.GATEWAY_REVISION_WEIGHT,
            "Percent of a tier's traffic the routing table gives each model revision.",
            ["tier", "revision"], registry=r,
        )  # fmt: skip
        self.revision_healthy = Gauge(
            names.GATEWAY_REVISION_HEALTHY_BACKENDS,
            "Backends of each model revision that are not ejected.",
            ["tier", "revision"], registry=r,
        )  # fmt: skip

        self.revision_golden = Gauge(
            names.GATEWAY_REVISION_GOLDEN_PASSED,
            "1 when every backend of a new model revision asked so far answered the routing "
            "table's golden prompt (by index) right, 0 when one did not; absent until asked.",
            ["tier", "revision", "prompt"], registry=r,
        )  # fmt: skip

        self.routing_generation = Gauge(
            names.GATEWAY_ROUTING_GENERATION,
            "Generation of the routing table in use (the operator's rollout counter).",
            registry=r,
        )
        self.speeds = ReplicaSpeeds(r)
        self.tier_reachable = Gauge(
            names.GATEWAY_TIER_REACHABLE, "1 while a remote tier (across a WAN) answers its "
            "probes, 0 while none of its backends does.", ["tier"], registry=r,
        )  # fmt: skip

    def serve_revisions(self, tiers: Mapping[str, Any]) -> None:
        """Export each revision's weight and healthy backends as the routing table says
        now (called on every reload and every scrape); revisions gone are dropped."""
        for gauge in (self.revision_weight, self.revision_healthy):
            gauge.clear()
        for name, pool in tiers.items():
            for revision, weight in pool.revision_weights().items():
                self.revision_weight.labels(tier=name, revision=revision).set(weight)
                healthy = [r for r in pool.healthy() if r.revision == revision]
                self.revision_healthy.labels(tier=name, revision=revision).set(len(healthy))

    def serve_tiers(self, tiers: Iterable[str]) -> None:
        """Export the per-tier demand series at zero from the start: a tier nobody has asked
        yet has no load, which an autoscaler must be able to tell from a missing metric."""
        for tier in tiers:
            self.prompt_tokens.labels(tier=tier)
            self.completion_tokens.labels(tier=tier)
            self.offered.prompt.labels(tier=tier)
            self.offered.completion.labels(tier=tier)
            self.offered.stranded_prompt.labels(tier=tier)
            self.offered.stranded_completion.labels(tier=tier)
            self.outstanding.labels(tier=tier)
            self.ttft.labels(tier=tier)
            self.held.labels(tier=tier)
            self.cold.labels(tier=tier)


SPEED_REFERENCE_LOAD = speed.REFERENCE_LOAD  # the busy batch the time per token is given at


class ReplicaSpeeds:
    """Each replica's speed, learned from its streamed answers (`hybridllm_common.speed`),
    and its figures as gauges by tier and replica URL, for the router and the autoscaler
    to read. A replica gone from the routing table is forgotten, its series removed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.table = speed.SpeedTable()
        labels = ["tier", "replica"]
        self.overhead = Gauge(
            names.GATEWAY_REPLICA_OVERHEAD_SECONDS, "Fixed time of an answer on each replica, "
            "the network to it included (fitted from its times to first token).",
            labels, registry=r,
        )  # fmt: skip
        self.prefill = Gauge(
            names.GATEWAY_REPLICA_PREFILL_TOKENS_PER_SECOND,
            "Prompt tokens per second each replica processes (fitted from its times to "
            "first token).", labels, registry=r,
        )  # fmt: skip
        self.wait = Gauge(
            names.GATEWAY_REPLICA_WAIT_SECONDS, "Time each request already in flight on a "
            "replica adds to a new request's first token (fitted).", labels, registry=r,
        )  # fmt: skip
        self.output = Gauge(
            names.GATEWAY_REPLICA_OUTPUT_SECONDS, "Seconds per output token on each replica, "
            f"with one answer in flight (load=1) and with {SPEED_REFERENCE_LOAD} "
            f"(load={SPEED_REFERENCE_LOAD}), fitted.", [*labels, "load"], registry=r,
        )  # fmt: skip
        self.answers = Counter(
            names.GATEWAY_REPLICA_ANSWERS_TOTAL,
            "Streamed answers each replica's figures were learned from.", labels, registry=r,
        )  # fmt: skip
        self.error = Histogram(
            names.GATEWAY_PREDICTION_RATIO, "Each answer's time over what the replica's "
            "learned speed predicted for it just before, by tier and term (ttft: the first "
            "token; tpot: the time per output token).", ["tier", "term"],
            buckets=names.PREDICTION_RATIO_BUCKETS, registry=r,
        )  # fmt: skip

    def answered(self, tier: str, url: str, answer: speed.Answer) -> None:
        before = self.table.of(tier, url)
        if before is not None and answer.valid():  # the prediction this answer tests
            ttft = before.predict_ttft(answer.prompt_tokens, answer.load)
            if ttft > 0:
                self.error.labels(tier=tier, term="ttft").observe(answer.ttft_s / ttft)
            steps = max(answer.output_tokens - 1, 1)
            tpot = before.predict_tpot(answer.load, answer.stalled_tokens / steps)
            if tpot > 0 and answer.output_tokens >= 2:
                actual = answer.decode_s / (answer.output_tokens - 1)
                self.error.labels(tier=tier, term="tpot").observe(actual / tpot)
        fitted = self.table.observe(tier, url, answer)
        self.answers.labels(tier=tier, replica=url).inc()
        if not fitted.ready():
            return
        self.overhead.labels(tier=tier, replica=url).set(fitted.overhead_s)
        rate = fitted.prefill_tokens_per_s
        if rate is not None:
            self.prefill.labels(tier=tier, replica=url).set(rate)
        else:  # not (or no longer) measurable: no figure rather than a stale one
            with contextlib.suppress(KeyError):
                self.prefill.remove(tier, url)
        self.wait.labels(tier=tier, replica=url).set(fitted.wait_s_per_request)
        for load in (1, SPEED_REFERENCE_LOAD):
            self.output.labels(tier=tier, replica=url, load=str(load)).set(
                fitted.predict_tpot(load)
            )

    def keep(self, live: set[tuple[str, str]]) -> None:
        """Forget the replicas not in ``live``, (tier, URL) pairs of the routing table."""
        for tier, url in self.table.keep(live):
            for gauge in (self.overhead, self.prefill, self.wait, self.answers):
                with contextlib.suppress(KeyError):
                    gauge.remove(tier, url)
            for load in (1, SPEED_REFERENCE_LOAD):
                with contextlib.suppress(KeyError):
                    self.output.remove(tier, url, str(load))


OFFERED_WINDOW = 256  # a tier's answers whose mean length estimates a new request's


class OfferedDemand:
    """The demand offered to each tier, counted when a request is routed to it.

    What a tier answered lags what it was asked whenever it is short of replicas (queued
    requests are answered later, a saturated pool answers at its capacity, a refused one
    not at all); an autoscaler fed the answers learns a rise only as fast as the pool met
    it. So the gateway also counts each request on arrival: its prompt tokens (the
    router's estimate) and its completion tokens, which are not known yet, estimated by
    the mean of the tier's last `OFFERED_WINDOW` answers and capped by the request's
    ``max_tokens`` x ``n``. A request that arrives before its tier has answered any is
    counted when the first answer gives the mean.

    An offered request refused because its tier is unreachable from here (a site gateway
    with its WAN down) is counted again, the same way, as *stranded*: the demand the tier's
    own gateways never saw, which the site's agent sends up once the WAN is back.
    """

    def __init__(
        self, prompt: Counter, completion: Counter, stranded_prompt: Counter,
        stranded_completion: Counter, window: int = OFFERED_WINDOW,
    ) -> None:  # fmt: skip
        self.prompt, self.completion = prompt, completion
        self.stranded_prompt, self.stranded_completion = stranded_prompt, stranded_completion
        self.window = window
        self.recent: dict[str, deque[int]] = {}
        self.sums: dict[str, int] = {}
        # (tier, completion counter) -> {cap: requests} not counted yet for want of a mean
        self.pending: dict[tuple[str, Counter], Tally[int | None]] = {}

    def mean(self, tier: str) -> float | None:
        recent = self.recent.get(tier)
        return self.sums[tier] / len(recent) if recent else None

    def offer(self, tier: str, prompt_tokens: int, cap: int | None) -> None:
        """A request routed to ``tier``; ``cap`` bounds its completion tokens (None: none)."""
        self._count(tier, prompt_tokens, cap, self.prompt, self.completion)

    def strand(self, tier: str, prompt_tokens: int, cap: int | None) -> None:
        """An offered request refused because ``tier`` is unreachable from this gateway."""
        self._count(tier, prompt_tokens, cap, self.stranded_prompt, self.stranded_completion)

    def _count(
        self, tier: str, prompt_tokens: int, cap: int | None, prompt: Counter, completion: Counter
    ) -> None:
        prompt.labels(tier=tier).inc(prompt_tokens)
        mean = self.mean(tier)
        if mean is None:
            self.pending.setdefault((tier, completion), Tally())[cap] += 1
        else:
            completion.labels(tier=tier).inc(mean if cap is None else min(mean, cap))

    def answered(self, tier: str, completion_tokens: int) -> None:
        """A whole answer of ``tier`` (2xx) with its completion tokens."""
        recent = self.recent.setdefault(tier, deque())
        recent.append(completion_tokens)
        self.sums[tier] = self.sums.get(tier, 0) + completion_tokens
        if len(recent) > self.window:
            self.sums[tier] -= recent.popleft()
        mean = self.mean(tier)
        for counter in (self.completion, self.stranded_completion):
            pending = self.pending.pop((tier, counter), None)
            if pending and mean is not None:
                counter.labels(tier=tier).inc(
                    sum(n * (mean if cap is None else min(mean, cap)) for cap, n in pending.items())
                )


STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip


def request_kind(body: Mapping[str, Any]) -> str:
    """``tools`` (tools offered and not turned off), ``structured`` (an output format) or
    ``text``: the label of ``hybridllm_gateway_request_kinds_total``."""
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
        body.get(f) is not None for f in STRUCTURED_FIELDS
    ):
        return "structured"
    return "text"


def completion_cap(body: Mapping[str, Any]) -> int | None:
    """The most completion tokens a request can be answered with (max_tokens x n), or
    None when it sets no max_tokens."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        return None
    n = body.get("n")
    return max_tokens * (n if isinstance(n, int) and n > 1 else 1)
