"""The closed-loop autoscaling replay's harness (bench/autoscaling/replay.py): the load it
offers follows the compressed trace, every mode gets the same arrivals, its numbers are
the arithmetic they claim, and its replicas stay token servers under the supervisor."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml

from hybridllm_operator.local import plan as plan_mod


@pytest.fixture(scope="module")
def replay(bench_module) -> ModuleType:
    return bench_module("bench/autoscaling/replay.py")  # type: ignore[no-any-return]


def _args(**changes: Any) -> argparse.Namespace:
    """The replay's pool and autoscaling arguments, as its command line gives them."""
    base = {"max_replicas": 3, "slots": 2, "slo_ttft_s": 1.0, "interval_s": 5, "lead_s": 10,
            "scale_down_delay_s": 10, "replica": "slots"}  # fmt: skip
    return argparse.Namespace(**{**base, **changes})


def test_a_compressed_day_keeps_its_shape_and_is_scaled_to_the_peak(replay: ModuleType) -> None:
    window_s = 600.0
    day = np.arange(144, dtype=float) + 1.0  # a rising day
    rates = np.concatenate([day * 10, day * 20, day * 30])
    t, rate = replay.compressed_rate(rates, window_s, 60.0, start_day=1, days=2, peak=5.0)
    assert len(t) == 288
    assert t[0] == pytest.approx(60.0 / 144 / 2)
    assert t[-1] < 120.0
    assert rate.max() == pytest.approx(5.0)
    assert rate[143] / rate[0] == pytest.approx(144.0)  # the shape, not just the peak
    with pytest.raises(ValueError, match="no 3 days from day 1"):
        replay.compressed_rate(rates, window_s, 60.0, start_day=1, days=3, peak=5.0)


def test_arrivals_follow_the_rate_and_are_the_same_for_a_seed(replay: ModuleType) -> None:
    t = np.array([0.0, 100.0, 200.0])
    rate = np.array([10.0, 50.0, 10.0])
    a = replay.arrivals(t, rate, 200.0, seed=3)
    assert np.array_equal(a, replay.arrivals(t, rate, 200.0, seed=3))
    assert not np.array_equal(a, replay.arrivals(t, rate, 200.0, seed=4))
    assert np.all(np.diff(a) >= 0)
    assert a[0] >= 0
    assert a[-1] < 200.0
    expected = 0.5 * (10 + 50) * 200  # the integral of the rate
    assert abs(len(a) - expected) < 4 * np.sqrt(expected)
    # more arrivals in the middle, where the rate peaks, than at the ends
    middle = np.count_nonzero((a > 75) & (a < 125))
    ends = np.count_nonzero(a < 25) + np.count_nonzero(a > 175)
    assert middle > 1.5 * ends


def test_lead_lag_finds_the_shift_between_replicas_and_load(replay: ModuleType) -> None:
    t = np.arange(0.0, 600.0, 1.0)
    need = 3 + 2 * np.sin(2 * np.pi * t / 300)
    early = np.interp(t + 12, t, need)  # replicas move 12 s before the load
    late = np.interp(t - 20, t, need)  # 20 s after it
    assert replay.lead_lag_s(t, early, need, 60.0, 1.0) == pytest.approx(12.0, abs=1.0)
    assert replay.lead_lag_s(t, late, need, 60.0, 1.0) == pytest.approx(-20.0, abs=1.0)


def test_the_summary_counts_failures_as_misses_and_integrates_replicas(
    replay: ModuleType,
) -> None:
    R = replay.Result
    results = [
        R(1.0, 200, 0.3, 0.5), R(2.0, 200, 1.5, 1.8),  # met, late
        R(3.0, 503, None, None, "busy"), R(4.0, 0, None, None, "ClientError: reset"),
        R(50.0, 200, 0.1, 0.2),  # outside the window
    ]  # fmt: skip
    # (t, running, ready, desired): 2 replicas for 5 s, then 4 (one loading) for 5 s
    samples = [(float(i), 2, 2, 2) for i in range(5)] + [(float(i), 4, 3, 4) for i in range(5, 10)]
    out = replay.summarise(
        results, samples, (0.0, 10.0), np.array([0.0, 10.0]), np.array([5.0, 5.0]),
        per_replica_rps=2.0, slo_s=1.0,
    )  # fmt: skip
    assert out["requests"] == 4
    assert out["failed"] == 2
    assert out["slo_attainment"] == pytest.approx(0.25)
    assert out["errors"] == {"503": 1, "ClientError": 1}
    assert out["replica_seconds"] == pytest.approx(2 * 5 + 4 * 5)
    assert out["ready_replica_seconds"] == pytest.approx(2 * 5 + 3 * 5)
    assert out["under_provisioned_s"] == pytest.approx(5.0)  # 2 ready x 2 rps < 5 rps
    assert out["scale_changes"] == 1


def test_replicas_are_placed_as_token_servers_first_and_when_the_supervisor_re_renders(
    replay: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor re-renders every replica from the spec and restarts one that
    differs: its placement must give the same token server, or it would swap the runtime
    back in (what the first version of the replay did)."""
    monkeypatch.setattr(plan_mod, "place", plan_mod.place)  # restored after the test
    args = _args()
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(replay.manifest("hybrid", args)))
    replay.place_token_servers(2, 5.0)
    manifest = plan_mod.load_manifest(path)
    plan = plan_mod.make_plan(manifest, tmp_path, gateway_port=plan_mod.free_ports(1)[0])
    runtime = [r for r in plan.replicas if r.component != "gateway"]
    assert len(runtime) == 3
    assert [r.standby for r in runtime] == [False, True, True]
    for r in runtime:
        assert Path(r.command[1]).parts[-2:] == ("bench", "tokenserver.py")
        assert r.command[r.command.index("--port") + 1] == str(r.port)
        assert r.command[r.command.index("--max-concurrency") + 1] == "2"
        assert r.command[r.command.index("--startup-s") + 1] == "5.0"
        pool = next(p for p in plan_mod.builders.pools(plan.service()) if p.component == "edge")
        assert plan_mod.place(pool, r.index, r.port, standby=r.standby) == r
    # the capacity the autoscaler is told is the token server's: 2 slots / 0.35 s, for a
    # request as the gateway counts it (100 prompt tokens, 4 streamed)
    capacity = manifest.spec.edge.pool.capacity
    assert capacity is not None
    per_request = 100 / capacity.prefill_tokens_per_second + 4 / capacity.decode_tokens_per_second
    assert 1 / per_request == pytest.approx(2 / replay.service_s(), rel=0.02)
    assert manifest.spec.autoscaling.target_utilization == 0.7  # the default


def test_a_mode_at_a_utilisation_is_its_own_service_with_that_target(
    replay: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args()
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(replay.manifest("reactive@0.5", args)))
    manifest = plan_mod.load_manifest(path)
    assert manifest.name == replay.service_name("reactive@0.5") == "replay-reactive-u050"
    assert manifest.spec.autoscaling.mode == "reactive"
    assert manifest.spec.autoscaling.target_utilization == 0.5
    assert replay.service_name("hybrid") == "replay-hybrid"
    for bad, says in [("reactive@x", "not a number"), ("moon", "not one of"),
                      ("hybrid@1.5", "within 0.05 to 1")]:  # fmt: skip
        with pytest.raises(SystemExit):
            replay.main(["--modes", f"hybrid,{bad}"])
        assert says in capsys.readouterr().err
    # `+auto`: the same service with its capacity left out (learned), and on engine
    # replicas the pool's slots are the replica's, which the learned capacity batches by
    engine = _args(replica="engine")
    path.write_text(yaml.safe_dump(replay.manifest("hybrid@0.5+auto", engine)))
    learning = plan_mod.load_manifest(path)
    assert learning.name == replay.service_name("hybrid@0.5+auto") == "replay-hybrid-u050-auto"
    assert learning.spec.edge.pool.capacity is None
    assert learning.spec.edge.parallel == 2
    assert learning.spec.autoscaling.target_utilization == 0.5
    path.write_text(yaml.safe_dump(replay.manifest("hybrid", engine)))
    typed = plan_mod.load_manifest(path).spec.edge.pool.capacity
    assert typed is not None
    # the replica's parameters: a full batch of 2 streams, each step 50 ms + 5 ms
    assert (typed.prefill_tokens_per_second, typed.decode_tokens_per_second) == (5000, 36)
    engine.typed_capacity = (4870.4, 33.2)  # hybridllm profile's figures, as the replay types
    path.write_text(yaml.safe_dump(replay.manifest("hybrid", engine)))
    typed = plan_mod.load_manifest(path).spec.edge.pool.capacity
    assert typed is not None
    assert (typed.prefill_tokens_per_second, typed.decode_tokens_per_second) == (4870, 33)
    # the learned capacity is read from the status line the autoscaler writes
    from hybridllm_forecaster.capacity import DEFAULT_POOLS, CapacityModel
    from hybridllm_operator.llmservice import autoscaling

    pool = DEFAULT_POOLS["edge"].with_(capacity=CapacityModel.from_rates(1234.0, 38.0, 2))
    line = f"learned from 1,500 answers: {autoscaling.describe(pool)}"  # as the status has it
    got = replay.learned_capacity({"autoscaling": {"capacity": {"edge": line}}})
    assert got == (1500, 1234.0, 38.0)
    assert (
        replay.learned_capacity({"autoscaling": {"capacity": {"edge": "defaults until"}}}) is None
    )


def test_step_days_repeat_one_sharp_rise_and_its_response_is_measured_from_it(
    replay: ModuleType,
) -> None:
    t, rate, rises = replay.step_rate(3, 100.0, 20.0)
    assert rises == [40.0, 140.0, 240.0]
    assert np.all(np.diff(t) >= 0)
    assert t[-1] == 300.0
    at = np.array([10.0, 39.0, 41.5, 60.0, 75.0, 110.0, 141.5])
    assert np.interp(at, t, rate).tolist() == pytest.approx([5, 5, 20, 20, 5, 5, 20], abs=0.01)
    R = replay.Result
    results = [R(39.0, 200, 0.2, 0.3), R(40.5, 200, 0.2, 0.3), R(45.0, 200, 2.0, 2.2),
               R(50.0, 503, None, None, "busy"), R(110.0, 200, 0.2, 0.3)]  # fmt: skip
    # 4 replicas of 2 rps carry 8 of the 20; 10 asked for from 32 s, ready from 35 s on
    samples = [(float(x), 10, 4, 10 if x >= 32 else 4) for x in range(30, 35)]
    samples += [(float(x), 10, 10, 10) for x in range(35, 60)]
    out = replay.rise_response(results, samples, 40.0, 20.0, 2.0, 1.0, 1.0)
    assert out["peak_asked_at_s"] == pytest.approx(-8.0)
    assert out["peak_carried_at_s"] == pytest.approx(-5.0)
    assert out["requests"] == 3  # sent from the rise to a minute after it
    assert out["slo_attainment"] == pytest.approx(1 / 3)
    never = replay.rise_response(results, samples[:5], 40.0, 20.0, 2.0, 1.0, 1.0)
    assert never["peak_carried_at_s"] is None


@pytest.fixture(scope="module")
def operator_replay(bench_module) -> ModuleType:
    return bench_module("bench/autoscaling/operator_replay.py")  # type: ignore[no-any-return]


def test_the_cluster_replay_applies_the_replays_service_and_measures_what_the_operator_set(
    operator_replay: ModuleType,
) -> None:
    from hybridllm_common import crd

    args = _args(max_replicas=10)
    doc = operator_replay.service_manifest("reactive@0.5", args)
    assert doc["metadata"] == {"name": "replay-reactive-u050", "namespace": "replay"}
    spec = crd.LLMServiceSpec.model_validate(doc["spec"])
    assert spec.autoscaling.target_utilization == 0.5
    assert spec.edge.pool.max_replicas == 10
    assert spec.edge.pool.resources.cpu == "250m"  # 3 modes x 10 replicas fit a kwok node

    # samples: (t, pods, ready, replicas set, ...); 2 rps a replica; the load steps from
    # 4 to 20 rps at t = 40 s; the operator sets 10 at 35 s, ready at 37 s
    rate_t, rate = np.array([0.0, 39.5, 40.0, 100.0]), np.array([4.0, 4.0, 20.0, 20.0])
    samples = [(float(t), 2, 2, 2) for t in range(35)]
    samples += [(float(t), 10, 2 if t < 37 else 10, 10) for t in range(35, 100)]
    rise = operator_replay.rise_times(samples, 40.0, 20.0, 2.0)
    assert rise == {"set_s": -5.0, "ready_s": -3.0}
    # a flare to the peak's replicas that fell back before the rise is not readiness for it
    flare = [(t, 10, 10, 10) if 10 <= t < 15 else x for x in samples for t in [x[0]]]
    assert operator_replay.rise_times(flare, 40.0, 20.0, 2.0) == rise
    day = operator_replay.day_summary(samples, (0.0, 100.0), rate_t, rate, 2.0, 10)
    assert day["replica_seconds"] == pytest.approx(35 * 2 + 65 * 10)
    assert day["max_replicas_set"] == 10
    assert day["within_max"]
    assert day["scale_changes"] == 1
    assert day["under_provisioned_s"] == 0.0  # ready before the rise
    late = [(t, p, 2 if t < 45 else s, s) for t, p, _, s in samples]
    assert operator_replay.day_summary(late, (0.0, 100.0), rate_t, rate, 2.0, 10)[
        "under_provisioned_s"
    ] == pytest.approx(5.0)  # 40 s to 45 s: 2 ready replicas carry 4 of the 20 rps
    assert not operator_replay.day_summary(samples, (0.0, 100.0), rate_t, rate, 2.0, 8)[
        "within_max"
    ]
