"""The control plane's metrics: what the autoscaler and the rollout controller decided,
per LLMService and pool, read from their live state at each scrape.

One collector for the operator (every LLMService it reconciles) and local mode (the one
service it runs): each hands a function that lists its services' current
`ServiceView`. Nothing is copied at decision time, so a scrape always shows the state
the status and the Events report, and a service that is gone stops being exported.

Names and labels (``namespace``, ``llmservice``, ``pool``) are those of
`hybridllm_common.metrics`; docs/metrics.md lists them (``hybridllm observability generate``). The
replica-denominated series (demand, forecast band, each policy's replicas) share one
unit, replicas at the target utilisation, so the autoscaling dashboard draws them on one
axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridllm_common import crd
from hybridllm_common import metrics as names
from hybridllm_operator.llmservice import autoscaling

SERVICE_LABELS = ["namespace", "llmservice"]
POOL_LABELS = [*SERVICE_LABELS, "pool"]
PHASES = [p.value for p in crd.RolloutPhase]


@dataclass(frozen=True)
class ServiceView:
    """One LLMService as the control loops hold it now."""

    namespace: str
    name: str
    spec: crd.LLMServiceSpec | None = None
    scaling: autoscaling.ServiceAutoscaler | None = None
    rollout: crd.RolloutStatus | None = None


class ControlPlaneCollector(Collector):
    """Gauges and counters of every service ``views()`` lists, built at each scrape."""

    def __init__(self, views: Callable[[], Iterable[ServiceView]]) -> None:
        self.views = views

    def describe(self) -> Iterable[Metric]:
        return []  # built per scrape: no fixed description to register against

    def collect(self) -> Iterator[Metric]:
        g = _Families()
        for view in list(self.views()):
            service = [view.namespace, view.name]
            if view.spec is not None:
                g.slo_ttft.add_metric(service, view.spec.slo.ttft_p95_seconds)
                g.slo_tbt.add_metric(service, view.spec.slo.tbt_p95_seconds)
                g.slo_availability.add_metric(service, view.spec.slo.availability)
            if view.scaling is not None:
                _pools(g, service, view.scaling)
            if view.rollout is not None:
                _rollout(g, service, view.rollout)
        yield from g.all()


class _Families:
    def __init__(self) -> None:
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        self.slo_ttft = gauge(
            names.SERVICE_SLO_TTFT_SECONDS,
            "The service's time-to-first-token objective (p95), seconds.", SERVICE_LABELS,
        )  # fmt: skip
        self.slo_tbt = gauge(
            names.SERVICE_SLO_TBT_SECONDS,
            "The service's time-between-tokens objective (p95), seconds.", SERVICE_LABELS,
        )  # fmt: skip
        self.slo_availability = gauge(
            names.SERVICE_SLO_AVAILABILITY_RATIO,
            "The service's availability objective: the share of requests to answer without "
            "a 5xx (its error budget is the rest).", SERVICE_LABELS,
        )  # fmt: skip
        self.desired = gauge(
            names.AUTOSCALER_DESIRED_REPLICAS,
            "Replicas the autoscaler set for the pool (what its Deployment gets).", POOL_LABELS,
        )  # fmt: skip
        self.provisioned = gauge(
            names.AUTOSCALER_PROVISIONED_REPLICAS,
            "Replicas the pool runs (ready and starting) at the last decision.", POOL_LABELS,
        )  # fmt: skip
        self.ready = gauge(
            names.AUTOSCALER_READY_REPLICAS,
            "Replicas of the pool that serve, at the last decision.", POOL_LABELS,
        )  # fmt: skip
        self.policy = gauge(
            names.AUTOSCALER_POLICY_REPLICAS,
            "Replicas each policy asked for (reactive, predictive) and the combined "
            "recommendation, before the capacity and SLO guards.", [*POOL_LABELS, "policy"],
        )  # fmt: skip
        self.demand = gauge(
            names.AUTOSCALER_DEMAND_REPLICAS,
            "The load the pool carried at the last decision, in replicas at the target "
            "utilisation.", POOL_LABELS,
        )  # fmt: skip
        self.forecast = gauge(
            names.AUTOSCALER_FORECAST_REPLICAS,
            "The forecast of the load over the scale-up lead time, in replicas at the target "
            "utilisation, by quantile (0.5, 0.9).", [*POOL_LABELS, "quantile"],
        )  # fmt: skip
        self.forecast_error = gauge(
            names.AUTOSCALER_FORECAST_ERROR_RATIO,
            "Recent relative error of the forecast against what came.", POOL_LABELS,
        )  # fmt: skip
        self.bound = gauge(
            names.AUTOSCALER_CAPACITY_BOUND,
            "1 when the pool wants more replicas than the cluster can schedule.", POOL_LABELS,
        )  # fmt: skip
        self.available = gauge(
            names.AUTOSCALER_METRICS_AVAILABLE,
            "1 when the pool's load metric was read at the last decision (0: holding).",
            POOL_LABELS,
        )  # fmt: skip
        self.decision = gauge(
            names.AUTOSCALER_DECISION_INFO,
            "The last decision's cause as a label, its direction and driver in a few fixed "
            "words (e.g. 'scale up: forecast'; value 1, one series per pool); the full "
            "reason, with its numbers, is in the LLMService's status and Events.",
            [*POOL_LABELS, "cause"],
        )  # fmt: skip
        self.scaled = CounterMetricFamily(
            names.AUTOSCALER_SCALE_EVENTS_TOTAL.removesuffix("_total"),
            "Replica changes the autoscaler applied, by direction (up, down).",
            labels=[*POOL_LABELS, "direction"],
        )
        self.replica_seconds = CounterMetricFamily(
            names.AUTOSCALER_REPLICA_SECONDS_TOTAL.removesuffix("_total"),
            "Replica-seconds the pool has run (replicas times time, between decisions).",
            labels=POOL_LABELS,
        )
        self.phase = gauge(
            names.ROLLOUT_PHASE,
            "1 for the rollout's current phase, 0 for the others.", [*SERVICE_LABELS, "phase"],
        )  # fmt: skip
        self.step = gauge(
            names.ROLLOUT_STEP, "The rollout's current step (0-based).", SERVICE_LABELS
        )
        self.steps = gauge(names.ROLLOUT_STEPS, "The rollout's number of steps.", SERVICE_LABELS)
        self.weight = gauge(
            names.ROLLOUT_CANARY_WEIGHT,
            "Percent of the tier's traffic on the canary revision.", [*SERVICE_LABELS, "tier"],
        )  # fmt: skip
        self.analysis = gauge(
            names.ROLLOUT_ANALYSIS_VALUE,
            "The last step analysis: each metric's value on the canary and the stable "
            "revision (role), per tier.", [*SERVICE_LABELS, "metric", "tier", "role"],
        )  # fmt: skip
        self.verdict = gauge(
            names.ROLLOUT_ANALYSIS_RESULT,
            "The last step analysis's verdict per metric and tier: 1 for its result (pass, "
            "fail, inconclusive).", [*SERVICE_LABELS, "metric", "tier", "result"],
        )  # fmt: skip

    def all(self) -> list[Metric]:
        return [m for m in vars(self).values() if isinstance(m, Metric)]


def _pools(g: _Families, service: list[str], scaling: autoscaling.ServiceAutoscaler) -> None:
    # No lock: `step` swaps whole attributes (and can hold its lock through a slow
    # forecast fit); each is read once here.
    desired, decisions, observed = scaling.desired, scaling.decisions, scaling.observed
    demand, events, seconds = scaling.demand, scaling.scale_events, scaling.replica_seconds
    targets = {c: s.pool.target_utilisation for c, s in list(scaling.scalers.items())}
    for pool in sorted(targets):
        labels = [*service, pool]
        if pool in desired:
            g.desired.add_metric(labels, desired[pool])
        seen = observed.get(pool)
        if seen is not None:
            g.provisioned.add_metric(labels, seen.replicas)
            g.ready.add_metric(labels, seen.ready)
        if pool in demand:
            g.demand.add_metric(labels, demand[pool] / targets[pool])
        g.replica_seconds.add_metric(labels, seconds.get(pool, 0.0))
        for direction in ("up", "down"):
            g.scaled.add_metric([*labels, direction], events.get((pool, direction), 0))
        decision = decisions.get(pool)
        if decision is None:
            continue
        for policy, value in (
            ("reactive", decision.reactive),
            ("predictive", decision.predictive),
            ("recommended", decision.recommended),
        ):
            if value is not None:
                g.policy.add_metric([*labels, policy], value)
        for quantile, value in (("0.5", decision.predicted_p50), ("0.9", decision.predicted_p90)):
            if value is not None and math.isfinite(value):
                g.forecast.add_metric([*labels, quantile], value)
        if decision.forecast_error is not None and math.isfinite(decision.forecast_error):
            g.forecast_error.add_metric(labels, decision.forecast_error)
        g.bound.add_metric(labels, float(decision.capacity_bound))
        g.available.add_metric(labels, float(decision.metrics_available))
        g.decision.add_metric([*labels, decision.cause], 1.0)


def _rollout(g: _Families, service: list[str], state: crd.RolloutStatus) -> None:
    for phase in PHASES:
        g.phase.add_metric([*service, phase], float(state.phase.value == phase))
    g.step.add_metric(service, state.step)
    g.steps.add_metric(service, state.steps)
    for tier, weight in sorted(state.weights.items()):
        g.weight.add_metric([*service, tier], weight)
    for verdict in state.analysis:
        tier = verdict.tier or ""
        for role, value in (("canary", verdict.canary), ("stable", verdict.stable)):
            if value is not None:
                g.analysis.add_metric([*service, verdict.metric, tier, role], value)
        g.verdict.add_metric([*service, verdict.metric, tier, verdict.result], 1.0)


def operator_views(memo: Any) -> Iterator[ServiceView]:
    """The services the operator's daemons hold (kopf's memo: each running LLMService's
    ``jobs.ServiceState``; empty before it starts and on a standby)."""
    services = dict(getattr(memo, "services", None) or {})
    for key in sorted(services):
        state = services[key]
        yield ServiceView(
            key[0], key[1], spec=state.scaling.spec, scaling=state.scaling,
            rollout=state.rollouts.state,
        )  # fmt: skip


class OperatorMetrics:
    """The operator's registry (no process-wide globals): the collector over ``views``,
    and whether this replica leads."""

    def __init__(self, views: Callable[[], Iterable[ServiceView]] = lambda: []) -> None:
        self.views = views
        self.leading = False
        # who leads, as this replica last read the Lease ("pod NAME in NAMESPACE"; None:
        # no election, or not read yet): the page of a standby points there
        self.leader_is: Callable[[], str | None] = lambda: None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ControlPlaneCollector(views))
        self.leader = Gauge(
            names.OPERATOR_LEADER,
            "1 while this operator replica holds the Lease and reconciles (0: standby).",
            registry=self.registry,
        )

    def lead(self, leading: bool) -> None:
        self.leading = leading
        self.leader.set(int(leading))


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (an empty host: every interface); ValueError names a bad one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT (e.g. 0.0.0.0:8081)")
    return host or "0.0.0.0", int(port)
