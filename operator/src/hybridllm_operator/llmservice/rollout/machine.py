"""Staged rollouts of a new model revision: the state machine, one implementation for
the operator and local mode.

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
profile that the autoscaler's history gives, in
:func:`hybridllm_operator.llmservice.rollout.observe.look`), the status shows it, and the rollout
starts when that time comes, or at once on ``hybridllm rollout start``.

Like :mod:`hybridllm_operator.llmservice.rollout.plan`, nothing here does I/O, nor imports what does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from hybridllm_common import crd
from hybridllm_operator.llmservice.rollout.plan import (
    ACTION_ANNOTATION,
    ACTIONS,
    CAPACITY_HOLD,
    FAIL,
    FORECAST_HOLD,
    INCONCLUSIVE,
    STEPPING,
    Event,
    Observation,
    Phase,
    enabled_tiers,
    needs_golden,
    shown_weight,
    spec_wire,
    stable_spec,
    step_tiers,
    steps,
    window_of,
)


def _held(
    state: crd.RolloutStatus, message: str, marker: str = FORECAST_HOLD
) -> tuple[crd.RolloutStatus, list[Event]]:
    """A step that holds (for the forecast, or for room for the canary: ``marker`` is in
    the message); one Event as the hold begins."""
    events: list[Event] = []
    if marker not in state.message:
        events.append(("Warning", "RolloutHeld", message))
    return _to(state, state.phase, message), events


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
        if verdict.outcome == FAIL:
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
    if verdict.outcome == FAIL:
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
    if verdict.outcome == INCONCLUSIVE:
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
