"""The pure queries of a rollout: its steps, the tiers a step moves, the canary's
weights and sizing, the rollout window, the forecast hold and what a step still owes
(analysis, golden prompts), from the spec and ``status.rollout`` alone.

Nothing here does I/O, nor imports what does: the state machine
(:mod:`hybridllm_operator.llmservice.rollout.machine`) and the status and builders read these, and
the observation side (:mod:`hybridllm_operator.llmservice.rollout.observe`) decides from them what
to read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from hybridllm_common import crd
from hybridllm_forecaster import windows

if TYPE_CHECKING:
    from hybridllm_operator.llmservice import analysis
    from hybridllm_operator.llmservice.autoscaling import ServiceAutoscaler

Phase = crd.RolloutPhase
ENDED = (Phase.completed, Phase.aborted)  # nothing to drive until a new revision comes
ACTION_ANNOTATION = f"{crd.GROUP}/rollout-action"
ACTIONS = ("start", "promote", "promote-full", "abort", "pause", "resume")
# Phases in which the canary's pools exist (and the routing table has two revisions).
CANARY_PHASES = frozenset({
    Phase.progressing, Phase.paused, Phase.inconclusive, Phase.failed,
    Phase.promoting, Phase.finalizing, Phase.aborting,
})  # fmt: skip
# Phases in which a step is running (analysed, promotable, abortable).
STEPPING = frozenset({Phase.progressing, Phase.inconclusive, Phase.paused, Phase.failed})
EARLY_LOOK_FACTOR = 10  # a step is failed before its pause ends only at significance / 10

Event = tuple[str, str, str]  # type (Normal, Warning), reason, message

# The analysis's outcomes the machine acts on (`hybridllm_operator.llmservice.analysis` reads
# Prometheus, which the pure side does not import).
FAIL, INCONCLUSIVE = crd.VERDICT_FAIL, crd.VERDICT_INCONCLUSIVE


@dataclass(frozen=True)
class Observation:
    """What the controller saw at ``now``."""

    now: float
    canary_ready: bool = False  # the canary's pools: every replica updated and available
    stable_ready: bool = False  # the stable pools: rolled out to the stable spec's revision
    routed: bool = False  # every gateway serves this routing generation, canary healthy
    verdict: analysis.Verdict | None = None  # the step's window, when one was analysed
    action: str | None = None  # a hand command (the annotation's value)
    actions_seen: bool = False  # `action` was read from the object (None: no command)
    canary_problem: str | None = None  # why the canary's pods cannot run (crash, no image)
    # the canary's pools short of their size for the step: which ("edge 1/2 ready")
    canary_short: str | None = None
    # the scheduler's reason a canary replica cannot be placed (no room left in the cluster)
    canary_unschedulable: str | None = None
    golden: analysis.Verdict | None = None  # the golden prompts on the canary, once all asked
    fleet: FleetView | None = None  # the service's EdgeFleet's rollout (spec.edge.devices)
    # only the spec is new (the reconcile's look): start, restart or abort a rollout on a
    # new revision; what the pools, gateways and fleet say is the rollout loop's to judge
    spec_only: bool = False
    planned: windows.Planned | None = None  # a scheduled rollout's start, planned now
    # why the next move of traffic waits: a pool it moves is forecast past its maximum
    forecast_hold: str | None = None


@dataclass(frozen=True)
class FleetView:
    """The rollout of the service's EdgeFleet as its status says (the fleet server's)."""

    name: str
    phase: crd.FleetRolloutPhase | None = None
    revision: str | None = None  # the revision its rollout takes the devices to
    message: str = ""
    current: str | None = None  # the revision the fleet hands out now

    @classmethod
    def of(cls, name: str, status: dict[str, Any] | None) -> FleetView:
        current = (status or {}).get("currentRevision")
        raw = (status or {}).get("rollout")
        if not raw:
            return cls(name, current=current)
        try:
            r = crd.FleetRolloutStatus.model_validate(raw)
        except ValueError:
            return cls(name, current=current)
        return cls(name, r.phase, r.to_revision, r.message, current)

    def took(self, revision: str) -> bool:
        """Whether the fleet's devices were taken to ``revision``: its rollout of it
        completed (or the fleet's first config was it: no rollout was needed)."""
        if self.phase is None:
            return self.current == revision
        return self.phase == crd.FleetRolloutPhase.Completed and self.revision == revision


def spec_wire(spec: crd.LLMServiceSpec) -> str:
    return json.dumps(spec.to_wire(), sort_keys=True, separators=(",", ":"))


def stable_spec(state: crd.RolloutStatus, spec: crd.LLMServiceSpec) -> crd.LLMServiceSpec:
    """The spec the stable pools run (the live spec when none is recorded)."""
    if not state.stable_spec:
        return spec
    return crd.LLMServiceSpec.model_validate(json.loads(state.stable_spec))


def window_from(w: crd.RolloutWindow) -> windows.Window:
    """A window of the spec (an LLMService's rollout, a fleet's waves) as the planner
    takes it."""
    return windows.Window(
        schedule=tuple(crd.window_range_seconds(r) for r in w.schedule),
        below_peak=w.below_peak_percent / 100 if w.below_peak_percent is not None else None,
        max_delay_s=float(w.max_delay_seconds),
    )


def window_of(spec: crd.LLMServiceSpec) -> windows.Window | None:
    """``spec.rollout.window`` as the planner takes it (None: start at once)."""
    w = spec.rollout.window
    if w is None or spec.rollout.strategy == crd.RolloutStrategy.rolling:
        return None
    return window_from(w)


def expected_duration_s(spec: crd.LLMServiceSpec) -> float:
    """How long a rollout takes when every step passes: its steps' pauses, the canary's
    cold start and the stable pools' rolling update (one cold start each)."""
    pauses = sum(s.pause_seconds for s in steps(spec))
    return float(pauses + 2 * spec.autoscaling.scale_up_lead_seconds)


def steps(spec: crd.LLMServiceSpec) -> list[crd.RolloutStep]:
    """The steps a rollout takes: blueGreen is one step at 100% (the new revision at full
    size, analysed against its bounds, then switched)."""
    if spec.rollout.strategy == crd.RolloutStrategy.blue_green:
        return [crd.RolloutStep(weight=100, pause_seconds=spec.rollout.steps[-1].pause_seconds)]
    return list(spec.rollout.steps)


def enabled_tiers(spec: crd.LLMServiceSpec) -> list[str]:
    return [t for t in ("edge", "cloud") if getattr(spec, t).enabled]


def step_tiers(step: crd.RolloutStep, spec: crd.LLMServiceSpec) -> list[str]:
    """The tiers a step moves: those it names, else every enabled one."""
    return [t.value for t in step.tiers] if step.tiers else enabled_tiers(spec)


def canary_weight(state: crd.RolloutStatus | None, tier: str) -> int:
    """The canary's percent of one tier's traffic now."""
    if state is None or state.phase not in CANARY_PHASES:
        return 0
    return state.weights.get(tier, 0)


def sizing_weight(state: crd.RolloutStatus, spec: crd.LLMServiceSpec, tier: str) -> int:
    """The weight a tier's canary pools are sized for: the step's it is at (or heading
    for) when that step moves the tier, else what the tier has now."""
    if state.phase in (Phase.promoting, Phase.finalizing):
        return 100
    plan = steps(spec)
    step = plan[min(state.step, len(plan) - 1)]
    if tier in step_tiers(step, spec):
        return step.weight
    return state.weights.get(tier, 0)


def heading_step(state: crd.RolloutStatus, spec: crd.LLMServiceSpec) -> crd.RolloutStep | None:
    """The step the rollout's next move of traffic goes to: the current step until every
    tier it moves has its weight, then the next (None: the promotion is next)."""
    plan = steps(spec)
    at = min(state.step, len(plan) - 1)
    step = plan[at]
    if any(state.weights.get(t, 0) != step.weight for t in step_tiers(step, spec)):
        return step
    return plan[at + 1] if at + 1 < len(plan) else None


def sizing_seconds(state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec) -> float:
    """How long the canary serves the weight it is sized for (`sizing_weight`): that
    step's pause (0 once promoting), what a forecast of its pools' demand covers beyond
    their lead time."""
    if state is None or state.phase not in STEPPING:
        return 0.0
    plan = steps(spec)
    return float(plan[min(state.step, len(plan) - 1)].pause_seconds)


def canary_forecast(
    scaling: ServiceAutoscaler | None, state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec
) -> dict[str, float]:
    """What a canary's pools are sized from beyond their share of the replicas now
    (`canary_size`): each pool's forecast need over its lead time and the step's pause,
    while a rollout has a canary and the autoscaler applies its decisions."""
    if scaling is None or not scaling.applies or not has_canary(state):
        return {}
    return scaling.forecast_needs(sizing_seconds(state, spec))


class Need(Protocol):
    """(replicas at the target utilisation the forecast P90 asks for, maxReplicas) of a
    pool over its lead time and ``beyond_s`` more (`ServiceAutoscaler.forecast_need`)."""

    def __call__(self, component: str, *, beyond_s: float) -> tuple[float, int] | None: ...


FORECAST_HOLD = "holds for the forecast"  # in the message while a step holds for it
CAPACITY_HOLD = "holds for room in the cluster"  # while the canary's replicas cannot be placed


def forecast_hold(
    state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec, need: Need
) -> str | None:
    """Why the rollout's next move of traffic should wait, or None: a pool of a tier that
    move shifts (the current step's tiers; every tier at the last step, whose pass
    promotes) is forecast to need more replicas than its maximum over its lead time and
    the step's pause (as far as the forecast reaches). A canary's cold start, and a
    rollback if it fails, take capacity the pool will not have then; the move waits
    until the forecast falls (or `promote --full` by hand)."""
    if state is None or state.phase not in (Phase.progressing, Phase.inconclusive):
        return None
    plan = steps(spec)
    at = min(state.step, len(plan) - 1)
    tiers = set(enabled_tiers(spec) if at == len(plan) - 1 else step_tiers(plan[at], spec))
    heading = heading_step(state, spec)
    beyond = float(heading.pause_seconds) if heading is not None else 0.0
    for component in crd.scaled_pools(spec):
        if crd.pool_tier(component) not in tiers:
            continue
        got = need(component, beyond_s=beyond)
        if got is not None and got[0] > got[1]:
            return (
                f"the {component} pool is forecast to need {got[0]:.1f} replicas (P90 over "
                f"its lead time and the step, at its target utilisation), over its "
                f"maxReplicas {got[1]}"
            )
    return None


def devices_step(spec: crd.LLMServiceSpec) -> int | None:
    """The first step that moves the service's edge devices (None: no step names them,
    and they follow the new revision from the rollout's start)."""
    return next((i for i, s in enumerate(steps(spec)) if s.devices), None)


def devices_on_canary(state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec) -> bool:
    """Whether the service's edge devices should run the canary's revision now: while
    the rollout has a canary, from the step that moves them on (from the start when no
    step names them). The fleet server reads this to pick what its waves hand out."""
    if state is None or not has_canary(state):
        return False
    first = devices_step(spec)
    if first is None or state.phase in (Phase.promoting, Phase.finalizing):
        return True
    return state.step >= first


def is_scheduled(state: crd.RolloutStatus | None) -> bool:
    """A new revision waits for its window (its start is planned at each look)."""
    return state is not None and state.phase == Phase.scheduled


def has_canary(state: crd.RolloutStatus | None) -> bool:
    return state is not None and state.phase in CANARY_PHASES


def needs_analysis(state: crd.RolloutStatus, spec: crd.LLMServiceSpec, now: float) -> float | None:
    """The significance to analyse the step's window at now, or None when no analysis is
    due (no step running, or its window not begun)."""
    if state.phase not in (Phase.progressing, Phase.inconclusive) or state.step_started_at is None:
        return None
    plan = steps(spec)
    step = plan[min(state.step, len(plan) - 1)]
    alpha = spec.rollout.analysis.significance
    final = now - state.step_started_at >= step.pause_seconds
    return alpha if final else alpha / EARLY_LOOK_FACTOR


def needs_golden(state: crd.RolloutStatus, spec: crd.LLMServiceSpec) -> bool:
    """Whether the canary still owes its golden prompts (asked once per canary, before
    any traffic moves to it)."""
    return bool(spec.rollout.analysis.golden_prompts) and state.golden is None


def _summary(state: crd.RolloutStatus) -> str:
    if state.phase in STEPPING:
        return f"{state.phase.value} {state.step + 1}/{state.steps} {state.weight}%"
    return state.phase.value


def summary(state: crd.RolloutStatus | None) -> str | None:
    """The printer column: 'Progressing 2/3 50%', 'Aborted', 'Completed'."""
    return None if state is None else _summary(state)


def shown_weight(state: crd.RolloutStatus, spec: crd.LLMServiceSpec) -> int:
    """The one weight the status shows: what the current step's tiers have while a step
    runs, else the largest of the tiers' (0 without a canary)."""
    if not has_canary(state):
        return 0
    if state.phase in STEPPING:
        plan = steps(spec)
        tiers = step_tiers(plan[min(state.step, len(plan) - 1)], spec)
        return max((state.weights.get(t, 0) for t in tiers), default=0)
    return max(state.weights.values(), default=0)
