"""Staged rollouts of a new model revision: the state machine, one implementation for
the operator and local mode.

A change of ``spec.model.revision`` starts a rollout. The new revision's pools (the
*canary*) are created beside the stable ones; the gateway's routing table gives each
revision a weight; every ``spec.rollout.steps`` entry raises the canary's weight, holds it
for the step's pause while the analysis (:mod:`hybridllm_operator.analysis`) compares the
canary with the stable revision over the same window, and moves on only when it passes.
When every step has passed, the stable pools take the new revision (the Deployments' own
rolling update, while the canary serves everything), traffic returns to them, and the
canary drains and goes. A failed step sends all traffic back to the stable revision at
once and drains the canary (``autoRollback``), or holds at the step (``autoRollback:
false``) until someone promotes or aborts it by hand.

:func:`advance` is a pure function of the last state, the spec and what was observed:
whether the canary's pools are ready, whether every gateway routes by the current
weights (:attr:`Observation.routed`), the analysis of the step's window and a hand
command. The whole state is the LLMService's ``status.rollout`` (the stable revision's
spec included), so a restarted operator resumes at the same step. A step moves the tiers
it names (every enabled tier by default), each tier's weight only ever going to a step's
weight or back to zero: no step is skipped and no tier gets more than the steps so far
gave it. The ``rolling`` strategy skips all of this: the pools update in place.

With ``spec.rollout.window`` a new revision first waits, *Scheduled*, while the stable
pools keep serving: the rollout loop plans the start each look
(:func:`hybridllm_forecaster.windows.plan_start`, from the schedule and the demand's day
profile that the autoscaler's history gives), the status shows it, and the rollout
starts when that time comes, or at once on ``hybridllm rollout start``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from hybridllm_common import crd
from hybridllm_forecaster import windows
from hybridllm_operator import analysis, demand
from hybridllm_operator.autoscaling import ServiceAutoscaler, tier_of

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
        if tier_of(component) not in tiers:
            continue
        got = need(component, beyond_s=beyond)
        if got is not None and got[0] > got[1]:
            return (
                f"the {component} pool is forecast to need {got[0]:.1f} replicas (P90 over "
                f"its lead time and the step, at its target utilisation), over its "
                f"maxReplicas {got[1]}"
            )
    return None


def _held(
    state: crd.RolloutStatus, message: str, marker: str = FORECAST_HOLD
) -> tuple[crd.RolloutStatus, list[Event]]:
    """A step that holds (for the forecast, or for room for the canary: ``marker`` is in
    the message); one Event as the hold begins."""
    events: list[Event] = []
    if marker not in state.message:
        events.append(("Warning", "RolloutHeld", message))
    return _to(state, state.phase, message), events


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


def golden_verdict(
    window: analysis.Window, state: crd.RolloutStatus, spec: crd.LLMServiceSpec, tiers: list[str]
) -> analysis.Verdict | None:
    """The golden prompts on the canary, from the gateways' verdicts: failed when one
    was answered wrong on any tier, passed when every one was answered right on every
    tier, else None (not all asked yet)."""
    prompts = spec.rollout.analysis.golden_prompts
    canary = str(state.canary_revision)
    if window.problem is not None:
        return None
    for tier in tiers:
        for index, golden in enumerate(prompts):
            if window.golden.get((tier, canary, index)) == 0:
                shown = golden.prompt if len(golden.prompt) <= 60 else golden.prompt[:57] + "..."
                return analysis.Verdict(
                    analysis.FAIL, [],
                    f"golden prompt {index + 1} ({shown!r}) answered wrong by {canary} on the "
                    f"{tier} tier: expected /{golden.expect}/ (the gateway's log has the answer)",
                )  # fmt: skip
    asked = all((t, canary, i) in window.golden for t in tiers for i in range(len(prompts)))
    if not asked:
        return None
    on = " and ".join(tiers)
    return analysis.Verdict(
        analysis.PASS, [], f"{len(prompts)} golden prompt(s) answered right by {canary} on {on}"
    )


def _summary(state: crd.RolloutStatus) -> str:
    if state.phase in STEPPING:
        return f"{state.phase.value} {state.step + 1}/{state.steps} {state.weight}%"
    return state.phase.value


def summary(state: crd.RolloutStatus | None) -> str | None:
    """The printer column: 'Progressing 2/3 50%', 'Aborted', 'Completed'."""
    return None if state is None else _summary(state)


def _start(state: crd.RolloutStatus, spec: crd.LLMServiceSpec, now: float) -> crd.RolloutStatus:
    plan = steps(spec)
    return state.model_copy(
        update={
            "phase": Phase.progressing, "canary_revision": spec.model.revision, "step": 0,
            "steps": len(plan), "weights": {}, "step_started_at": None,
            "started_at": now, "planned_start": None,
            "analysis": [], "routing_generation": state.routing_generation + 1,
            "golden": None,
            "message": f"waiting for the pools of {spec.model.revision} to be ready",
        }
    )  # fmt: skip


def _begin(
    state: crd.RolloutStatus, spec: crd.LLMServiceSpec, obs: Observation, why: str
) -> tuple[crd.RolloutStatus, list[Event]]:
    """A new revision in the spec: its rollout starts now, or is scheduled (a window)."""
    target = spec.model.revision
    if window_of(spec) is None:
        return _start(state, spec, obs.now), [("Normal", "RolloutStarted", why)]
    scheduled = _to(
        state, Phase.scheduled, f"{target} waits for its window (spec.rollout.window): "
        "planning its start", canary_revision=target, planned_start=None,
        scheduled_at=obs.now, step=0,
        steps=len(steps(spec)), weights={}, step_started_at=None, analysis=[], golden=None,
    )  # fmt: skip
    return _scheduled(scheduled, spec, obs, [])


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _scheduled(
    state: crd.RolloutStatus, spec: crd.LLMServiceSpec, obs: Observation, events: list[Event]
) -> tuple[crd.RolloutStatus, list[Event]]:
    """A scheduled rollout at a look: called off, started, or (re)planned."""
    target = spec.model.revision
    if target == state.stable_revision:
        done = _to(state, Phase.completed,
                   f"the scheduled rollout of {state.canary_revision} is called off: "
                   f"spec.model.revision is {target} again", canary_revision=None,
                   planned_start=None, stable_spec=spec_wire(spec))  # fmt: skip
        return done, [*events, ("Normal", "RolloutCalledOff", done.message)]
    if target != state.canary_revision:
        state = state.model_copy(
            update={"canary_revision": target, "planned_start": None, "scheduled_at": obs.now}
        )
    # While it waits, the stable pools follow every other change of the spec (replicas,
    # resources, routing): only the model stays the stable one's.
    kept = stable_spec(state, spec).model
    state = state.model_copy(
        update={"stable_spec": spec_wire(spec.model_copy(update={"model": kept}))}
    )
    if window_of(spec) is None:
        return _start(state, spec, obs.now), [
            *events, ("Normal", "RolloutStarted",
                      f"{state.stable_revision} -> {target} (spec.rollout.window removed)"),
        ]  # fmt: skip
    planned = obs.planned
    if planned is None:
        return state, events
    if obs.now >= planned.start_s:
        return _start(state, spec, obs.now), [
            *events,
            ("Normal", "RolloutStarted", f"{state.stable_revision} -> {target}: {planned.reason}"),
        ]
    first = state.planned_start is None
    state = _to(state, Phase.scheduled,
                f"{target} starts at {_utc(planned.start_s)}: {planned.reason} "
                "(`hybridllm rollout start` starts it now)",
                planned_start=planned.start_s)  # fmt: skip
    if first:
        events = [*events, ("Normal", "RolloutScheduled", state.message)]
    return state, events


def _to(state: crd.RolloutStatus, phase: Phase, message: str, **update: Any) -> crd.RolloutStatus:
    return state.model_copy(update={"phase": phase, "message": message, **update})


def _weight(
    state: crd.RolloutStatus, weight: int, tiers: list[str] | None = None, **update: Any
) -> dict[str, Any]:
    """The fields that set a new canary weight on ``tiers`` (None: every tier), with a new
    routing generation when that changes the table, and a new window."""
    weights = {**state.weights, **dict.fromkeys(tiers or ("edge", "cloud"), weight)}
    changed = weights != state.weights
    return {
        "weights": weights, "step_started_at": None,
        "routing_generation": state.routing_generation + changed, **update,
    }  # fmt: skip


def _abort(state: crd.RolloutStatus, why: str) -> crd.RolloutStatus:
    return _to(state, Phase.aborting, why, **_weight(state, 0))


def _promote(state: crd.RolloutStatus, spec: crd.LLMServiceSpec) -> crd.RolloutStatus:
    """Every step passed (or promoted by hand): the stable pools take the canary's spec
    while the canary serves all traffic."""
    return _to(
        state, Phase.promoting,
        f"every step passed: the stable pools take {state.canary_revision} while it serves "
        "all traffic",
        stable_spec=spec_wire(spec), stable_revision=str(state.canary_revision),
        **_weight(state, 100),
    )  # fmt: skip


def _next_step(
    state: crd.RolloutStatus, spec: crd.LLMServiceSpec, why: str
) -> tuple[crd.RolloutStatus, list[Event]]:
    plan = steps(spec)
    if state.step + 1 >= len(plan):
        return _promote(state, spec), [("Normal", "RolloutPromoting", why)]
    nxt = state.step + 1
    state = _to(state, Phase.progressing, f"step {nxt + 1}/{len(plan)}: waiting for the canary's pools",
                step=nxt, step_started_at=None, analysis=[])  # fmt: skip
    return state, [("Normal", "RolloutStepPassed", f"step {nxt}/{len(plan)} passed: {why}")]


def _act(
    state: crd.RolloutStatus, spec: crd.LLMServiceSpec, action: str, now: float
) -> tuple[crd.RolloutStatus, list[Event]]:
    verb = action.split("@", 1)[0].strip()
    handled = {"handled_action": action}
    if verb not in ACTIONS:
        return state.model_copy(update=handled), [
            ("Warning", "UnknownRolloutAction",
             f"{ACTION_ANNOTATION}={action!r}: not one of {', '.join(ACTIONS)}")
        ]  # fmt: skip
    state = state.model_copy(update=handled)
    phase, events = state.phase, [("Normal", "RolloutAction", f"{verb} by hand")]
    if verb == "start" and phase == Phase.scheduled:
        return _start(state, spec, now), [
            *events, ("Normal", "RolloutStarted",
                      f"{state.stable_revision} -> {spec.model.revision}, by hand before its "
                      "planned start"),
        ]  # fmt: skip
    if verb == "abort" and phase == Phase.scheduled:
        return _to(state, Phase.aborted,
                   f"the scheduled rollout of {state.canary_revision} aborted by hand; the "
                   f"stable revision {state.stable_revision} serves (set spec.model.revision "
                   f"back to {state.stable_revision}, or `hybridllm rollout resume` to start it)",
                   planned_start=None), events  # fmt: skip
    if verb == "abort" and phase in STEPPING:
        return _abort(state, "aborted by hand"), events
    if verb == "pause" and phase in (Phase.progressing, Phase.inconclusive):
        return _to(
            state, Phase.paused, "paused by hand: `hybridllm rollout resume` to go on"
        ), events
    if verb == "resume" and phase in (Phase.paused, Phase.failed):
        # a fresh window: what failed or what ran while paused is not judged again
        return _to(state, Phase.progressing, "resumed by hand", step_started_at=None), events
    if verb == "resume" and phase == Phase.aborted and spec.model.revision != state.stable_revision:
        return _start(state, spec, now), [
            ("Normal", "RolloutStarted", f"{spec.model.revision} again, by hand")
        ]
    if verb == "promote" and phase in STEPPING:
        nxt, more = _next_step(state, spec, "promoted by hand")
        return nxt, events + more
    if verb == "promote-full" and phase in STEPPING:
        return _promote(state, spec), events
    return state, [
        ("Warning", "RolloutActionIgnored", f"{verb}: nothing to do while {phase.value}")
    ]


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


def advance(
    state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec, obs: Observation
) -> tuple[crd.RolloutStatus, list[Event]]:
    """The next state of one LLMService's rollout, and the Events that say what changed."""
    new, events = _advance(state, spec, obs)
    return new.model_copy(update={"weight": shown_weight(new, spec)}), events


def _advance(
    state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec, obs: Observation
) -> tuple[crd.RolloutStatus, list[Event]]:
    target = spec.model.revision
    if state is None or spec.rollout.strategy == crd.RolloutStrategy.rolling:
        # first sight, or pools that update in place: the spec is the stable one
        message = "" if state is None else "strategy rolling: the pools update in place"
        return crd.RolloutStatus(
            phase=Phase.completed, stable_revision=target, stable_spec=spec_wire(spec),
            message=message, routing_generation=state.routing_generation if state else 0,
        ), []  # fmt: skip
    events: list[Event] = []
    if obs.action and obs.action != state.handled_action:
        before = state.phase
        state, events = _act(state, spec, obs.action, obs.now)
        if state.phase != before:
            # The rest of the observation was taken before the command: the stable pools
            # were ready on the old stable spec, not on the one a promotion just set.
            return state, events
    elif obs.actions_seen and not obs.action and state.handled_action:
        state = state.model_copy(update={"handled_action": None})  # the same may come again
    phase = state.phase
    if phase == Phase.completed:
        if target == state.stable_revision:
            return state.model_copy(update={"stable_spec": spec_wire(spec)}), events
        begun, more = _begin(state, spec, obs, f"{state.stable_revision} -> {target}")
        return begun, events + more
    if phase == Phase.scheduled:
        return _scheduled(state, spec, obs, events)
    if phase == Phase.aborted:
        if target == state.stable_revision:
            done = _to(state, Phase.completed, f"back on {target}", canary_revision=None,
                       stable_spec=spec_wire(spec))  # fmt: skip
            return done, events
        if target != state.canary_revision:
            begun, more = _begin(state, spec, obs, f"{state.stable_revision} -> {target}")
            return begun, events + more
        return state, events
    if phase in STEPPING and target == state.stable_revision:
        return _abort(state, f"spec.model.revision is {target} again"), [
            *events,
            ("Normal", "RolloutAborted", f"spec.model.revision set back to {target}"),
        ]
    if phase in STEPPING and target != state.canary_revision:
        restarted = _start(state, spec, obs.now)
        return restarted, [
            *events,
            ("Normal", "RolloutStarted", f"{target} replaces {state.canary_revision} mid-rollout"),
        ]
    plan = steps(spec)
    if phase in STEPPING and state.step >= len(plan):  # steps removed mid-rollout
        state = state.model_copy(update={"step": len(plan) - 1})
    state = state.model_copy(update={"steps": len(plan)})
    if obs.spec_only or phase in (Phase.paused, Phase.failed):
        return state, events
    if phase in (Phase.progressing, Phase.inconclusive):
        stepped, more = _step(state, spec, obs, plan)
        return stepped, events + more
    if phase == Phase.promoting:
        if obs.stable_ready:
            return _to(state, Phase.finalizing,
                       f"the stable pools run {state.stable_revision}: traffic back on them; "
                       "the canary drains", **_weight(state, 0)), events  # fmt: skip
        return state, events
    if phase in (Phase.finalizing, Phase.aborting) and obs.routed:
        if phase == Phase.finalizing:
            done = _to(state, Phase.completed, f"{state.stable_revision} rolled out",
                       canary_revision=None, analysis=[])  # fmt: skip
            return done, [*events, ("Normal", "RolloutCompleted", done.message)]
        return _to(state, Phase.aborted,
                   f"{state.message}; the stable revision {state.stable_revision} serves "
                   f"(set spec.model.revision back to {state.stable_revision}, or "
                   "`hybridllm rollout resume` to try again)"), events  # fmt: skip
    return state, events


def _step(
    state: crd.RolloutStatus,
    spec: crd.LLMServiceSpec,
    obs: Observation,
    plan: list[crd.RolloutStep],
) -> tuple[crd.RolloutStatus, list[Event]]:
    step = plan[state.step]
    where = f"step {state.step + 1}/{len(plan)}"
    canary = state.canary_revision
    if obs.canary_problem is not None:
        why = f"{where} failed: the pods of {canary} cannot run: {obs.canary_problem}"
        if spec.rollout.auto_rollback:
            return _abort(state, why), [("Warning", "RolloutAborted", why)]
        return _to(state, Phase.failed, why), [("Warning", "RolloutStepFailed", why)]
    if not obs.canary_ready and state.step_started_at is None:
        short = f" ({obs.canary_short})" if obs.canary_short else ""
        if obs.canary_unschedulable is not None:
            return _held(
                state, f"{where} {CAPACITY_HOLD}: the pools of {canary} are short of their "
                f"size for {step.weight}%{short} and the scheduler cannot place a replica: "
                f"{obs.canary_unschedulable}; the traffic moves once they run",
                CAPACITY_HOLD,
            )  # fmt: skip
        return _to(
            state, state.phase,
            f"{where}: waiting for the pools of {canary} to be ready for {step.weight}%{short}",
        ), []  # fmt: skip
    passed: list[Event] = []
    if needs_golden(state, spec):
        verdict = obs.golden
        if verdict is None:
            n = len(spec.rollout.analysis.golden_prompts)
            return _to(state, state.phase,
                       f"{where}: the gateways ask {canary} its {n} golden prompt(s)"), []  # fmt: skip
        if verdict.outcome == analysis.FAIL:
            why = f"{where} failed: {verdict.message}"
            state = state.model_copy(update={"golden": verdict.message})
            if spec.rollout.auto_rollback:
                return _abort(state, why), [("Warning", "RolloutAborted", why)]
            held = _to(state, Phase.failed,
                       f"{why}; held (autoRollback is off): `hybridllm rollout abort`, or "
                       "`resume` to go on regardless")  # fmt: skip
            return held, [("Warning", "RolloutStepFailed", why)]
        state = state.model_copy(update={"golden": verdict.message})
        passed = [("Normal", "GoldenPromptsPassed", verdict.message)]
    tiers = step_tiers(step, spec)
    if any(state.weights.get(t, 0) != step.weight for t in tiers):
        on = "" if tiers == enabled_tiers(spec) else f" on {' and '.join(tiers)}"
        if obs.forecast_hold is not None:
            held, more = _held(
                state, f"{where} {FORECAST_HOLD} before sending {step.weight}%{on} to {canary}: "
                f"{obs.forecast_hold}",
            )  # fmt: skip
            return held, passed + more
        return _to(state, Phase.progressing,
                   f"{where}: sending {step.weight}% of traffic{on} to {canary}",
                   **_weight(state, step.weight, tiers)), passed  # fmt: skip
    if state.step_started_at is None and step.devices:
        fleet = obs.fleet
        name = spec.edge.devices.fleet if spec.edge.devices is not None else "?"
        if (
            fleet is not None and fleet.revision == canary and fleet.phase is not None
            and fleet.phase in (crd.FleetRolloutPhase.RolledBack, crd.FleetRolloutPhase.Stopped)
        ):  # fmt: skip
            why = (f"{where} failed: the edge fleet {name} did not take {canary} "
                   f"({fleet.phase.value}): {fleet.message}")  # fmt: skip
            if spec.rollout.auto_rollback:
                return _abort(state, why), [("Warning", "RolloutAborted", why)]
            return _to(state, Phase.failed, why), [("Warning", "RolloutStepFailed", why)]
        if fleet is None or not fleet.took(str(canary)):
            doing = (
                f": {fleet.message}" if fleet and fleet.revision == canary and fleet.message else ""
            )
            return _to(state, state.phase,
                       f"{where}: waiting for the edge fleet {name} to take {canary} in its "
                       f"waves{doing}"), []  # fmt: skip
    if state.step_started_at is None:
        if not obs.routed:
            return _to(state, state.phase,
                       f"{where}: waiting for every gateway to route {step.weight}% to {canary}"), []  # fmt: skip
        return _to(state, Phase.progressing,
                   f"{where}: {step.weight}% on {canary}, analysing for {step.pause_seconds} s",
                   step_started_at=obs.now), []  # fmt: skip
    verdict = obs.verdict
    if verdict is None:
        return state, []
    elapsed = obs.now - state.step_started_at
    final = elapsed >= step.pause_seconds
    update = {"analysis": verdict.metrics}
    if verdict.outcome == analysis.FAIL:
        why = f"{where} failed: {verdict.message}"
        if spec.rollout.auto_rollback:
            return _abort(state.model_copy(update=update), why), [
                ("Warning", "RolloutAborted", why)
            ]
        held = _to(state, Phase.failed,
                   f"{why}; held at {step.weight}% (autoRollback is off): `hybridllm rollout "
                   "abort` or `promote`", **update)  # fmt: skip
        return held, [("Warning", "RolloutStepFailed", why)]
    if not final:
        left = step.pause_seconds - elapsed
        return _to(state, Phase.progressing,
                   f"{where}: {step.weight}% on {canary}, {left:.0f} s left; {verdict.message}",
                   **update), []  # fmt: skip
    if verdict.outcome == analysis.INCONCLUSIVE:
        return _to(state, Phase.inconclusive, f"{where} holds: {verdict.message}", **update), []
    if obs.forecast_hold is not None:
        nxt = "promotion" if state.step + 1 >= len(plan) else f"step {state.step + 2}/{len(plan)}"
        return _held(
            state.model_copy(update=update),
            f"{where} passed; {nxt} {FORECAST_HOLD}: {obs.forecast_hold}",
        )
    return _next_step(state.model_copy(update=update), spec, verdict.message)


@dataclass
class Readiness:
    """The pools as the last reconcile saw them, for the controller's next tick."""

    canary_ready: bool = False
    stable_ready: bool = False
    canary_problem: str | None = None
    canary_short: str | None = None
    canary_unschedulable: str | None = None


class Controller:
    """One LLMService's rollout: its state (restored from ``status.rollout``), advanced by
    the reconcile (spec changes) and by the rollout loop (readiness, routing, analysis,
    hand commands), one at a time."""

    def __init__(self, status: dict[str, Any] | None = None) -> None:
        self.lock = threading.Lock()
        self.state: crd.RolloutStatus | None = None
        self.readiness = Readiness()
        self.outbox: list[Event] = []  # Events to post (the daemon posts them)
        if status:
            try:
                self.state = crd.RolloutStatus.model_validate(status)
            except ValueError:
                self.state = None  # unreadable: start again from the spec

    def advance(self, spec: crd.LLMServiceSpec, obs: Observation) -> list[Event]:
        with self.lock:
            self.state, events = advance(self.state, spec, obs)
            self.outbox += events
            return events

    def take_events(self) -> list[Event]:
        with self.lock:
            out, self.outbox = self.outbox, []
            return out


def routed(window: analysis.Window, state: crd.RolloutStatus, tiers: list[str]) -> bool:
    """Whether every gateway serves the state's routing generation and, with the canary
    at a weight, has a healthy backend of the canary on each of its tiers."""
    if window.problem is not None or window.gateways == 0:
        return False
    if window.generation < state.routing_generation:
        return False
    for tier in tiers:
        live = canary_weight(state, tier) > 0 and state.canary_revision
        if live and window.healthy.get((tier, str(state.canary_revision)), 0.0) < 1:
            return False
    return True


def analyse(
    window: analysis.Window,
    state: crd.RolloutStatus,
    spec: crd.LLMServiceSpec,
    tiers: list[str],
    alpha: float,
) -> analysis.Verdict:
    """The step's verdict from its window: each tier the canary has traffic on, judged
    against the stable revision on the same tier (bounds only where the canary has it
    all), at ``alpha`` shared between the tiers; any failing tier fails the step."""
    if window.problem is not None:
        return analysis.Verdict(analysis.INCONCLUSIVE, [], f"no metrics: {window.problem}")
    judged = [t for t in tiers if canary_weight(state, t) > 0]
    if not judged:
        return analysis.Verdict(analysis.INCONCLUSIVE, [], "no tier sends the canary traffic")
    verdicts = {}
    for tier in judged:
        canary = window.revision(tier, str(state.canary_revision))
        stable = (
            window.revision(tier, state.stable_revision)
            if canary_weight(state, tier) < 100
            else None
        )
        verdicts[tier] = analysis.judge(canary, stable, spec.rollout.analysis, alpha / len(judged))
    return analysis.combine(verdicts)


def look(
    controller: Controller,
    spec: crd.LLMServiceSpec,
    source: analysis.WindowSource,
    action: str | None,
    fleet: FleetView | None = None,
    device_kpis: analysis.DeviceKpiSource | None = None,
    profile: windows.DayProfile | None = None,
    need: Need | None = None,
) -> Observation:
    """What the rollout loop sees now (the operator's and local mode's alike): the pools
    (``controller.readiness``, from the last reconcile), the gateways' routing and the
    step's window (read only while a canary exists), and a hand command. A scheduled
    rollout's start is planned from the window and the demand's day ``profile``; ``need``
    gives each pool's forecast need, which holds a move of traffic (`forecast_hold`)."""
    now = time.time()
    state = controller.state
    ready = controller.readiness
    if state is not None and state.phase == Phase.scheduled:
        window = window_of(spec)
        planned = (
            windows.plan_start(
                now, expected_duration_s(spec), window, profile, since_s=state.scheduled_at
            )
            if window is not None
            else None
        )
        return Observation(now, action=action, actions_seen=True, planned=planned)
    if state is None or not has_canary(state):
        return Observation(now, action=action, actions_seen=True)
    canary = spec if state.phase not in (Phase.promoting, Phase.finalizing) else None
    tiers = sorted({tier_of(c) for c in crd.scaled_pools(canary or spec)})
    window = source.read(state.step_started_at, now)
    alpha = needs_analysis(state, spec, now)
    verdict = analyse(window, state, spec, tiers, alpha) if alpha is not None else None
    if verdict is not None and fleet is not None and device_kpis is not None:
        verdict = with_devices(verdict, state, spec, device_kpis, fleet.name, now)
    golden = golden_verdict(window, state, spec, tiers) if needs_golden(state, spec) else None
    return Observation(
        now, canary_ready=ready.canary_ready, stable_ready=ready.stable_ready,
        routed=routed(window, state, tiers), verdict=verdict, action=action,
        actions_seen=True, canary_problem=ready.canary_problem, golden=golden, fleet=fleet,
        canary_short=ready.canary_short, canary_unschedulable=ready.canary_unschedulable,
        forecast_hold=forecast_hold(state, spec, need) if need is not None else None,
    )  # fmt: skip


def with_devices(
    verdict: analysis.Verdict,
    state: crd.RolloutStatus,
    spec: crd.LLMServiceSpec,
    source: analysis.DeviceKpiSource,
    fleet: str,
    now: float,
) -> analysis.Verdict:
    """The step's verdict with what the fleet's devices report, while a step that moved
    them runs: the canary revision's devices against the stable one's; their failure
    fails the step even when the gateways' window is still too small to judge."""
    plan = steps(spec)
    if state.phase not in STEPPING or not plan[min(state.step, len(plan) - 1)].devices:
        return verdict
    try:
        kpis = source.read(fleet, now)
    except demand.PrometheusError as exc:
        return analysis.Verdict(
            analysis.INCONCLUSIVE, verdict.metrics,
            f"{verdict.message}; devices: no KPIs from Prometheus ({exc})",
        )  # fmt: skip
    devices = analysis.judge_devices(
        kpis.get(str(state.canary_revision)), kpis.get(state.stable_revision),
        spec.rollout.analysis,
    )  # fmt: skip
    if devices is None:
        return verdict
    metrics = verdict.metrics + devices.metrics
    if devices.outcome == analysis.FAIL:
        return analysis.Verdict(analysis.FAIL, metrics, f"devices: {devices.message}")
    return analysis.Verdict(
        verdict.outcome, metrics, f"{verdict.message}; devices: {devices.message}"
    )


def tick_seconds(state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec) -> float:
    """How long the rollout loop waits before its next look: briefly while it waits for
    pools or gateways, an analysis interval while a step runs, longer when idle."""
    interval = float(spec.rollout.analysis.interval_seconds)
    if state is not None and state.phase == Phase.scheduled:
        # the plan moves with the forecast: look again within a minute, and at the start
        left = (state.planned_start or 0.0) - time.time()
        return max(1.0, min(60.0, left)) if state.planned_start is not None else 5.0
    if state is None or state.phase in (Phase.completed, Phase.aborted, Phase.paused, Phase.failed):
        return 5.0
    if state.phase in (Phase.progressing, Phase.inconclusive) and state.step_started_at:
        plan = steps(spec)
        left = plan[min(state.step, len(plan) - 1)].pause_seconds - (
            time.time() - state.step_started_at
        )
        return max(1.0, min(interval, left)) if left > 0 else interval
    return min(interval, 2.0)
