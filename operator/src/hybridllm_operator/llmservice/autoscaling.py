"""The autoscaler of one LLMService's pools: spec to policies, demand to decisions.

One `ServiceAutoscaler` per LLMService holds a `hybridllm_forecaster.autoscaler.PoolScaler`
per scaled pool (the edge pool and the cloud pools; the gateway keeps its spec replicas).
Each `step` reads the demand (`hybridllm_operator.llmservice.demand`), turns each tier's token rates
into the pool's work with the pool's capacity (`PoolConfig.work_per_s`: a prefill pool
counts prompt tokens, a decode pool output tokens), feeds the forecast the tier's
history and asks the policy. The operator's `jobs.AutoscalerJob` calls it every
``spec.autoscaling.intervalSeconds``; the reconcile then writes the replicas into the
Deployments and the decisions into the status.

What it remembers (the policies' windows, the replicas it set) is `state()`, which the
operator keeps in the LLMService's ``hybridllm.io/autoscaler`` annotation: a restarted
operator starts from it instead of the spec's replicas.

A pool's ``replicas`` in the spec is its starting point. Changing it while the autoscaler
owns the replicas starts the pool again from the new value (within its bounds), as at
creation: the Deployment gets it at once, and the reactive window counts it as a
recommendation made then (so a hand-raised pool holds for one ``scaleDownDelaySeconds``
unless the load needs more).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import crd
from hybridllm_common.speed import TierSpeed
from hybridllm_forecaster import autoscaler, windows
from hybridllm_forecaster.capacity import DEFAULT_POOLS, CapacityModel, PoolConfig, Slo
from hybridllm_operator.llmservice.demand import Snapshot, TierDemand

log = logging.getLogger(__name__)

STATE_ANNOTATION = f"{crd.GROUP}/autoscaler"
CLOUD_COMPONENTS = ("monolithic", "prefill", "decode")


def _within(config: PoolConfig, replicas: int) -> int:
    """``replicas`` held to the pool's bounds."""
    return int(min(config.max_replicas, max(config.min_replicas, replicas)))


def pool_config(component: str, pool: crd.PoolSpec, spec: crd.LLMServiceSpec) -> PoolConfig:
    """The forecaster's view of one pool, from the spec."""
    base = DEFAULT_POOLS[component]
    scaling = spec.autoscaling
    capacity = base.capacity
    if pool.capacity is not None:
        capacity = CapacityModel.from_rates(
            pool.capacity.prefill_tokens_per_second, pool.capacity.decode_tokens_per_second
        )
    return base.with_(
        name=component,
        capacity=capacity,
        slo=Slo(ttft_s=spec.slo.ttft_p95_seconds, tbt_s=spec.slo.tbt_p95_seconds),
        cold_start_s=float(scaling.scale_up_lead_seconds),
        control_interval_s=float(scaling.interval_seconds),
        min_replicas=pool.min_replicas,
        max_replicas=pool.max_replicas,
        target_utilisation=scaling.target_utilization,
        scale_down_stabilisation_s=float(scaling.scale_down_delay_seconds),
        # The forecast's part shrinks once its recommendation has stayed lower for one
        # lead time: a replica it raised is kept at least as long as one takes to start.
        # With no window a forecast that moves by one replica from bin to bin (noise)
        # starts a replica and retires it before it ever serves (the closed-loop replay,
        # bench/results/autoscaling-replay.md); the offline evaluation also chose a window
        # over none on the ServeGen trace (bench/results/forecaster.md).
        forecast_down_window_s=float(scaling.scale_up_lead_seconds),
    )


LEARN_MIN_ANSWERS = 64  # answers a tier's speed is fitted from before it replaces the defaults
DISAGREE = 0.3  # a hand-set capacity this far from the measured one is said in the status
LEARNABLE = ("monolithic", "edge")  # a disaggregated pool's share of an answer is not seen


def slots(component: str, spec: crd.LLMServiceSpec) -> int:
    """Requests one replica of the pool decodes together (its batch at most)."""
    if component == "edge" and spec.edge is not None:
        return spec.edge.parallel
    return spec.cloud.max_num_seqs if spec.cloud is not None else 1


def learned_capacity(speed: TierSpeed | None, max_batch: int) -> CapacityModel | None:
    """A replica's capacity from its tier's learned speed, once fitted from enough answers."""
    if speed is None or speed.answers < LEARN_MIN_ANSWERS or not speed.prefill_tok_s:
        return None
    step = speed.step_s()
    if step is None:
        return None
    return CapacityModel.from_speed(speed.prefill_tok_s, *step, max_batch)


def describe(config: PoolConfig) -> str:
    return (
        f"prefill {config.capacity.prefill_tok_s:,.0f} tokens/s, decode "
        f"{config.decode_tok_s:,.0f} tokens/s at batch {config.max_batch}"
    )


@dataclass(frozen=True)
class Observed:
    """One pool as the last reconcile saw it."""

    replicas: int  # the Deployment's spec.replicas
    ready: int
    unschedulable: int = 0  # pods the scheduler cannot place
    # Why one more replica cannot run, where that is known before trying (local mode: the
    # machine's cores are held); "" otherwise.
    bound: str = ""


@dataclass
class ServiceAutoscaler:
    """The pools' autoscalers of one LLMService, their decisions and what they set."""

    bin_s: float = 60.0
    model: str = "holt-winters"
    season_s: float = windows.DAY_S  # the demand's repeating period the forecast learns
    mode: str = "off"
    scalers: dict[str, autoscaler.PoolScaler] = field(default_factory=dict)
    desired: dict[str, int] = field(default_factory=dict)  # replicas this autoscaler set
    decisions: dict[str, autoscaler.Decision] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)  # tier -> why demand is missing
    observed: dict[str, Observed] = field(default_factory=dict)  # set by each reconcile
    # For the metrics (hybridllm_operator.observability.metrics), kept by `step`: each
    # pool's load at its last decision (work/s), the replica changes applied by direction,
    # and the replica-seconds run (provisioned replicas times the time between steps).
    demand: dict[str, float] = field(default_factory=dict)
    scale_events: dict[tuple[str, str], int] = field(default_factory=dict)
    replica_seconds: dict[str, float] = field(default_factory=dict)
    last_step_s: float | None = None
    spec: crd.LLMServiceSpec | None = None  # the last configured
    starting: dict[str, int] = field(default_factory=dict)  # each pool's spec replicas
    configs: dict[str, PoolConfig] = field(default_factory=dict)  # each pool's, from the spec
    pool_specs: dict[str, crd.PoolSpec] = field(default_factory=dict)  # the spec's pools
    slots: dict[str, int] = field(default_factory=dict)  # each pool's requests decoded at once
    # Each pool's capacity and where it comes from (the spec, learned, the defaults), for
    # the status; set by `step`.
    capacity: dict[str, str] = field(default_factory=dict)
    _saved: dict[str, Any] = field(default_factory=dict)  # restored state not yet used
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def configure(self, spec: crd.LLMServiceSpec) -> None:
        """Policies for the spec's pools; a pool whose settings did not change keeps its
        autoscaler (and what it remembers)."""
        with self.lock:
            self._configure(spec)
            self.spec = spec

    def _configure(self, spec: crd.LLMServiceSpec) -> None:
        mode = spec.autoscaling.mode.value
        pools = crd.scaled_pools(spec)
        wanted = {c: pool_config(c, p, spec) for c, p in pools.items()}
        starts = {c: p.replicas for c, p in pools.items()}
        moved = {c: n for c, n in starts.items() if self.starting.get(c, n) != n}
        self.starting = starts
        # what `_capacity` reads each step (a hand-set capacity, the slots), kept current
        # even when the pools' policies stay as they are
        self.pool_specs, self.slots = pools, {c: slots(c, spec) for c in pools}
        if (
            mode == self.mode
            and all(c in self.scalers and self.configs.get(c) == cfg for c, cfg in wanted.items())
            and len(wanted) == len(self.scalers)
        ):
            if moved:
                self._start_again(moved, wanted, self.scalers, dict(self.desired))
            return
        scalers: dict[str, autoscaler.PoolScaler] = {}
        desired: dict[str, int] = {}
        for component, config in wanted.items():
            old = self.scalers.get(component)
            if old is not None and self.configs.get(component) == config and old.mode == mode:
                scalers[component] = old
            else:
                fc = autoscaler.OnlineForecast.for_pool(
                    config, self.bin_s, model=self.model, season_s=self.season_s
                )
                scaler = autoscaler.PoolScaler(config, mode, fc)
                if old is not None:
                    scaler.restore(old.state())
                else:
                    scaler.restore((self._saved.pop(component, None) or {}).get("policy"))
                scalers[component] = scaler
            if component in self.desired:
                desired[component] = _within(config, self.desired[component])
        # Whole-attribute swaps: a reconcile in another thread reads one view or the other.
        self.mode, self.scalers, self.desired = mode, scalers, desired
        self.configs = wanted
        self.decisions = {c: d for c, d in self.decisions.items() if c in scalers}
        if moved:
            self._start_again(moved, wanted, scalers, dict(desired))

    def _start_again(
        self,
        moved: Mapping[str, int],
        wanted: Mapping[str, PoolConfig],
        scalers: Mapping[str, autoscaler.PoolScaler],
        desired: dict[str, int],
    ) -> None:
        """The spec's replicas of these pools changed: each starts again from them."""
        for component, replicas in moved.items():
            config = wanted[component]
            start = _within(config, replicas)
            if self.applies and desired.get(component, start) != start:
                log.info(
                    "%s: spec replicas set to %d, the autoscaler starts again from %d "
                    "(it had set %d)", component, replicas, start, desired[component],
                )  # fmt: skip
            desired[component] = start
            scalers[component].start_again()
        self.desired = desired

    def day_profile(self) -> windows.DayProfile | None:
        """The service's demand by time of day (every scaled pool's work, summed), from the
        history the pools' forecasts were last given; None before a whole day of it (or
        in modes that read no demand)."""
        with self.lock:
            histories = [s.forecast.history() for s in self.scalers.values()]
        histories = [(y, start) for y, start in histories if len(y)]
        if not histories:
            return None
        n = min(len(y) for y, _ in histories)  # the pools share their bins; align the ends
        total = sum(y[len(y) - n :] for y, _ in histories)
        start = histories[0][1] + (len(histories[0][0]) - n) * self.bin_s
        return windows.DayProfile.from_history(total, self.bin_s, start)

    def forecast_need(
        self, component: str, now_s: float | None = None, beyond_s: float = 0.0
    ) -> tuple[float, int] | None:
        """(replicas, maxReplicas): the replicas one pool needs at its target utilisation
        for the forecast P90 of its work over its lead time from ``now_s`` (default: now)
        and ``beyond_s`` more (a rollout step's pause), as far as the forecast reaches,
        and its maximum; None without a forecast (a pool this autoscaler does not scale,
        or too little history yet)."""
        now_s = time.time() if now_s is None else now_s
        with self.lock:
            scaler = self.scalers.get(component)
        if scaler is None or not scaler.forecast.ready:
            return None
        pool = scaler.pool
        work = scaler.forecast.forecast_max(now_s, now_s + pool.lead_time_s + beyond_s)
        return work / pool.target_utilisation, pool.max_replicas

    def forecast_needs(self, beyond_s: float = 0.0) -> dict[str, float]:
        """Each pool's forecast need in replicas (``forecast_need``), for those that have one."""
        with self.lock:
            components = list(self.scalers)
        out = {}
        for component in components:
            got = self.forecast_need(component, beyond_s=beyond_s)
            if got is not None:
                out[component] = got[0]
        return out

    @property
    def applies(self) -> bool:
        return self.mode in autoscaler.APPLYING

    def replicas(self) -> dict[str, int]:
        """Replicas the Deployments get (empty unless the mode applies its decisions)."""
        return dict(self.desired) if self.applies else {}

    def step(
        self, now_s: float, snapshot: Snapshot, observed: Mapping[str, Observed]
    ) -> dict[str, tuple[int, int]]:
        """Decide every pool; returns {component: (old, new)} for the replicas it changed."""
        with self.lock:
            return self._step(now_s, snapshot, observed)

    def _step(
        self, now_s: float, snapshot: Snapshot, observed: Mapping[str, Observed]
    ) -> dict[str, tuple[int, int]]:
        changed: dict[str, tuple[int, int]] = {}
        currents: dict[str, int] = {}  # the replicas of each pool decided now, before
        desired, decisions = dict(self.desired), dict(self.decisions)
        loads, events = dict(self.demand), dict(self.scale_events)
        seconds = dict(self.replica_seconds)
        capacity = dict(self.capacity)
        for component, scaler in list(self.scalers.items()):
            seen = observed.get(component)
            if seen is None:  # the Deployment does not exist yet: nothing to size
                continue
            tier = crd.pool_tier(component)
            demand = snapshot.tiers.get(tier)
            capacity[component] = self._capacity(component, scaler, demand)
            work = None
            violation = None
            if demand is not None:
                work = float(scaler.pool.work_per_s(demand.prompt_tok_s, demand.completion_tok_s))
                slo = scaler.pool.slo.ttft_s
                if demand.ttft_p95_s is not None and demand.ttft_p95_s > slo:
                    violation = (
                        f"{tier} p95 time to first token {demand.ttft_p95_s:.2f} s > {slo:g} s"
                    )
            history = snapshot.bins.get(tier) or []
            y = [float(scaler.pool.work_per_s(p, c)) for p, c in history]
            scaler.forecast.update(y, snapshot.bins_start_s)
            current = desired.get(component, seen.replicas)
            currents[component] = current
            decision = scaler.decide(
                now_s,
                min(seen.ready, current),
                current,
                autoscaler.Reading(
                    work,
                    demand.in_flight if demand else 0.0,
                    violation,
                    demand.waiting if demand else 0.0,
                    demand.overloaded if demand else 0.0,
                    demand.timed_out if demand else 0.0,
                ),
                unschedulable=seen.unschedulable,
                bound=seen.bound,
            )
            decisions[component] = decision
            if work is not None:
                loads[component] = work
            else:
                loads.pop(component, None)
            if self.last_step_s is not None and now_s > self.last_step_s:
                seconds[component] = seconds.get(component, 0.0) + seen.replicas * (
                    now_s - self.last_step_s
                )
        if self.applies and self.spec is not None and self.spec.autoscaling.gpu_budget:
            self._fit_budget(self.spec, decisions, currents, desired)
        for component, current in currents.items():
            decision = decisions[component]
            if self.applies:
                if decision.desired != current:
                    changed[component] = (current, decision.desired)
                    way = (component, "up" if decision.desired > current else "down")
                    events[way] = events.get(way, 0) + 1
                desired[component] = decision.desired
        # Whole-attribute swaps: a reconcile in another thread reads one view or the other.
        self.problems, self.decisions, self.desired = dict(snapshot.problems), decisions, desired
        self.demand, self.scale_events, self.replica_seconds = loads, events, seconds
        self.capacity = {c: v for c, v in capacity.items() if c in self.scalers}
        self.observed = dict(observed)  # local mode has no reconcile to record it
        self.last_step_s = now_s
        return changed

    def _capacity(
        self, component: str, scaler: autoscaler.PoolScaler, demand: TierDemand | None
    ) -> str:
        """Give the pool's scaler the capacity it sizes with: the spec's when set, else the
        one learned from the gateways' measurements of its tier (``capacity: auto``) once
        fitted from enough answers, else the defaults. What it is, in words."""
        config, pool = self.configs.get(component), self.pool_specs.get(component)
        if config is None or pool is None:
            return ""
        speed = demand.speed if demand is not None else None
        answers = f"{speed.answers:,.0f}" if speed is not None else "0"
        learned = None
        if component in LEARNABLE:
            learned = learned_capacity(speed, self.slots[component])
        if pool.capacity is not None:
            scaler.pool = config
            said = f"spec: {describe(config)}"
            if learned is not None:
                seen = config.with_(capacity=learned)
                ratios = (
                    learned.prefill_tok_s / config.capacity.prefill_tok_s,
                    seen.decode_tok_s / config.decode_tok_s,
                )
                if any(abs(r - 1.0) > DISAGREE for r in ratios):
                    said += (
                        f"; measured {describe(seen)} from {answers} answers "
                        f"(differs by more than {DISAGREE:.0%}: re-measure, or leave "
                        "capacity out to use the measured figures)"
                    )  # fmt: skip
            return said
        if learned is not None:
            scaler.pool = config.with_(capacity=learned)
            return f"learned from {answers} answers: {describe(scaler.pool)}"
        scaler.pool = config
        if component not in LEARNABLE:
            return (
                f"defaults: {describe(config)} (a disaggregated pool's capacity is not "
                f"learned: set spec.cloud.{component}.capacity, e.g. from hybridllm profile)"
            )
        if speed is not None and speed.answers >= LEARN_MIN_ANSWERS:
            why = (
                "the prefill rate: their prompts vary too little in length for the noise "
                "in their times to first token"
                if not speed.prefill_tok_s
                else "the decode step: it needs answers at one and at several at once"
            )
            return (
                f"defaults: {answers} answers do not measure {why} (hybridllm profile "
                f"measures it before traffic): {describe(config)}"
            )
        return (
            f"defaults until {LEARN_MIN_ANSWERS} answers are measured ({answers} so far): "
            f"{describe(config)}"
        )

    def _fit_budget(
        self,
        spec: crd.LLMServiceSpec,
        decisions: dict[str, autoscaler.Decision],
        currents: Mapping[str, int],
        desired: Mapping[str, int],
    ) -> None:
        """Cut the rises of this interval's decisions to ``spec.autoscaling.gpuBudget``;
        a pool not decided now (no Deployment yet) keeps the GPUs it holds."""
        budget = spec.autoscaling.gpu_budget
        assert budget is not None
        pools = crd.scaled_pools(spec)
        gpus = {c: p.resources.gpu for c, p in pools.items()}
        low = {c: p.min_replicas for c, p in pools.items()}
        want = {c: decisions[c].desired for c in currents}
        now = dict(currents)
        for c in pools:  # held, not decided: counted at what they run
            if c not in want and c in desired:
                want[c] = now[c] = desired[c]
        fit = autoscaler.fit_budget(want, now, low, gpus, budget)
        used = sum(fit[c] * gpus[c] for c in fit)
        for c in currents:
            if fit[c] >= want[c]:
                continue
            cut = decisions[c]
            up = fit[c] > currents[c]
            decisions[c] = dataclasses.replace(
                cut, desired=fit[c], budget_bound=True,
                cause="scale up: budget-bound" if up else "hold: budget-bound",
                reason=f"budget-bound: spec.autoscaling.gpuBudget is {budget} GPUs and the "
                f"pools would take {used} with this one at {fit[c]} replicas "
                f"({gpus[c]} GPU(s) each; wanted {want[c]}: {cut.reason})",
            )  # fmt: skip

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "pools": {
                c: {
                    "desired": self.desired.get(c),
                    "start": self.starting.get(c),
                    "policy": s.state(),
                }
                for c, s in self.scalers.items()
            },
        }

    def restore(self, raw: str | None) -> None:
        """Take back the annotation's state (before the first `configure`)."""
        try:
            state = json.loads(raw) if raw else {}
        except ValueError:
            state = {}
        pools = state.get("pools") if isinstance(state, dict) else None
        if not isinstance(pools, dict):
            return
        for component, saved in pools.items():
            if not isinstance(saved, dict):
                continue
            if isinstance(saved.get("desired"), int):
                self.desired[component] = saved["desired"]
            if isinstance(saved.get("start"), int):  # the spec's replicas then
                self.starting[component] = saved["start"]
            self._saved[component] = saved

    @staticmethod
    def saved_replicas(raw: str | None) -> dict[str, int]:
        """The replicas a saved state says were set (for a reconcile that runs before the
        autoscaler's first step after a restart)."""
        restored = ServiceAutoscaler()
        restored.restore(raw)
        return dict(restored.desired)


def metrics_condition(scaler: ServiceAutoscaler) -> tuple[bool, str, str] | None:
    """(status, reason, message) of MetricsAvailable, or None when nothing decides."""
    if scaler.mode not in autoscaler.DECIDING:
        return None
    tiers = {crd.pool_tier(c) for c in scaler.scalers}
    missing = {t: scaler.problems[t] for t in sorted(tiers) if t in scaler.problems}
    if missing:
        message = "; ".join(f"{t}: {why}" for t, why in missing.items())
        return False, "MetricsMissing", message + " (holding replicas)"
    if not scaler.decisions:
        return False, "NotYetRead", "the autoscaler has not read the demand yet"
    return True, "MetricsRead", "demand read for every scaled pool"


def summary_key(scaler: ServiceAutoscaler) -> tuple[str, tuple[bool, str, str] | None]:
    return summary(scaler), metrics_condition(scaler)


def summary(scaler: ServiceAutoscaler) -> str:
    """The printer column (one word): the mode, and what holds it back if anything does
    (``hybrid:no-metrics``: holding, no demand metric; ``hybrid:capacity-bound``;
    ``hybrid:budget-bound``)."""
    mode = scaler.mode
    if mode not in autoscaler.DECIDING:
        return mode
    if any(t in scaler.problems for t in {crd.pool_tier(c) for c in scaler.scalers}):
        return f"{mode}:no-metrics"
    if any(d.capacity_bound for d in scaler.decisions.values()):
        return f"{mode}:capacity-bound"
    if any(d.budget_bound for d in scaler.decisions.values()):
        return f"{mode}:budget-bound"
    return mode


def pool_fields(decision: autoscaler.Decision) -> dict[str, Any]:
    """PoolStatus fields for a decision."""

    def fmt(x: float | None) -> str | None:
        return None if x is None else f"{x:.1f}"

    return {
        "recommended_replicas": decision.recommended,
        "reactive_replicas": decision.reactive,
        "predictive_replicas": decision.predictive,
        "predicted_p50": fmt(decision.predicted_p50),
        "predicted_p90": fmt(decision.predicted_p90),
        "forecast_error": None
        if decision.forecast_error is None
        else f"{100 * decision.forecast_error:.0f}%",
        "capacity_bound": decision.capacity_bound or None,
        "budget_bound": decision.budget_bound or None,
        "scaling_reason": decision.reason[:1024],
    }
