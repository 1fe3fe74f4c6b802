"""What the rollout loop observes for the state machine: the gateways' routing and the
step's window (:mod:`hybridllm_operator.llmservice.analysis`, which compares the canary with the
stable revision over the same window), the golden prompts' and the edge devices'
verdicts, a scheduled rollout's planned start, and how long to wait before the next look.
"""

from __future__ import annotations

import time

from hybridllm_common import crd
from hybridllm_forecaster import windows
from hybridllm_operator.llmservice import analysis, demand
from hybridllm_operator.llmservice.rollout.machine import Controller
from hybridllm_operator.llmservice.rollout.plan import (
    STEPPING,
    FleetView,
    Need,
    Observation,
    Phase,
    canary_weight,
    expected_duration_s,
    forecast_hold,
    has_canary,
    needs_analysis,
    needs_golden,
    steps,
    window_of,
)


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
    tiers = sorted({crd.pool_tier(c) for c in crd.scaled_pools(canary or spec)})
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
