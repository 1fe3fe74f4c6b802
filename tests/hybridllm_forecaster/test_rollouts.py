"""The rollout models the simulator replays (`hybridllm_forecaster.rollouts`) and their
place in the fluid simulator."""

from __future__ import annotations

import numpy as np
import pytest

from hybridllm_forecaster import policies, rollouts
from hybridllm_forecaster.capacity import DEFAULT_POOLS
from hybridllm_forecaster.fluid import simulate_fluid
from hybridllm_forecaster.simresult import integrate_changes
from hybridllm_forecaster.stream import DemandSeries

POOL = DEFAULT_POOLS["monolithic"].with_(max_replicas=200)
C = POOL.cold_start_s
DT = POOL.control_interval_s


def _drive(overlay, ready: int, until_s: float) -> list[tuple[float, int, int]]:  # type: ignore[no-untyped-def]
    """(time, serving, paid) of a pool steady at ``ready`` replicas, every control step."""
    out = []
    for k in range(int(until_s / DT)):
        now = k * DT
        stable = overlay.cap(now, ready)
        serving, paid = overlay.step_at(now, stable, stable, DT)
        out.append((now, serving, paid))
    return out


def test_a_canary_runs_beside_the_pool_moves_traffic_once_up_and_promotes_in_one_cold_start():
    roll = rollouts.CanaryRollout(start_s=600.0, cold_start_s=C, room=200)
    trace = _drive(roll, 40, 6 * 3600)
    assert roll.end_s is not None
    # 10%: 4 replicas up after a cold start, 300 s; 50%: 16 more, a cold start, 300 s;
    # 100%: 20 more, a cold start; the promotion: one cold start
    expected = 600 + (C + 300) + (C + 300) + C + C
    assert roll.end_s == pytest.approx(expected, abs=3 * DT)
    paid = {t: p for t, _, p in trace}
    assert paid[0.0] == 40
    assert paid[600.0] == 44  # the 10% canary is paid from its start, cold
    serving = {t: s for t, s, _ in trace}
    assert serving[600.0] == 40  # and serves once it runs
    assert serving[600.0 + C + DT] == 44
    # while the stable pool restarts, the full-size canary serves everything
    promote = roll.end_s - C / 2
    at = max(t for t in serving if t <= promote)
    assert serving[at] == 40
    assert paid[at] == 80
    assert paid[max(paid)] == 40  # the canary is gone at the end
    assert all(p <= 200 for p in paid.values())


def test_the_canary_waits_for_room_and_the_safe_rules_wait_for_the_forecast():
    # room for 65: the 100% step's 40 canary replicas beside 40 stable ones cannot run
    tight = rollouts.CanaryRollout(start_s=0.0, cold_start_s=C, room=65)
    trace = _drive(tight, 40, 4 * 3600)
    assert tight.end_s is None
    assert tight.step == 2
    assert tight.weight == 50  # held at 50%: its replicas for 100% do not fit
    assert tight.canary == 25  # as many as fit, waiting for room for the rest
    assert max(p for _, _, p in trace) <= 65
    # capacity-safe: no move while the forecast need is past the room
    need = {"now": 300.0}
    safe = rollouts.CanaryRollout(
        start_s=0.0, cold_start_s=C, room=200, need=lambda now, beyond: need["now"]
    )
    _drive(safe, 40, 3600)
    assert safe.weight == 0
    assert safe.held_s >= 3600 - C - 2 * DT
    # and the surge: the canary is sized for its share of the forecast, not of the 40 now
    need["now"] = 120.0
    safe = rollouts.CanaryRollout(
        start_s=0.0, cold_start_s=C, room=200, need=lambda now, beyond: need["now"]
    )
    _drive(safe, 40, 60)
    assert safe.canary == 12  # 10% of 120
    blind = rollouts.CanaryRollout(start_s=0.0, cold_start_s=C, room=200)
    _drive(blind, 40, 60)
    assert blind.canary == 4


def test_an_in_place_update_takes_a_quarter_of_the_pool_out_for_each_round():
    roll = rollouts.InPlaceRollout(start_s=0.0, cold_start_s=C, room=200)
    trace = _drive(roll, 40, 3600)
    assert roll.end_s == pytest.approx(2 * C, abs=2 * DT)  # each round replaces half
    serving, paid = trace[1][1], trace[1][2]
    assert serving == 30
    assert paid == 50
    # no room for a surge: a quarter out at a time, four rounds
    full = rollouts.InPlaceRollout(start_s=0.0, cold_start_s=C, room=40)
    _drive(full, 40, 3600)
    assert full.end_s == pytest.approx(4 * C, abs=2 * DT)


def test_the_fluid_simulator_pays_and_serves_the_rollouts_replicas():
    n = 36  # six hours of 10-minute bins at a steady rate
    rate = np.full(n, 40.0)
    demand = DemandSeries(600.0, rate, rate * 1500.0, rate * 300.0, np.full(n, 1.5), "flat")
    work = float(POOL.work_series(demand)[0])

    def sim(overlay):  # type: ignore[no-untyped-def]
        policy = policies.Hpa(POOL, POOL.target_utilisation)
        return simulate_fluid(demand, POOL, policy, overlay=overlay)

    plain = sim(None)
    canary = sim(rollouts.CanaryRollout(start_s=3600.0, cold_start_s=C, room=200))
    in_place = sim(rollouts.InPlaceRollout(start_s=3600.0, cold_start_s=C, room=200))
    for result in (plain, canary, in_place):
        assert result.replica_hours == pytest.approx(
            integrate_changes(result.replica_changes, result.duration_s)
        )
    assert canary.replica_hours > plain.replica_hours  # the canary beside the pool costs
    assert canary.slo_attainment >= plain.slo_attainment  # and takes no capacity away
    assert work > 0
    assert in_place.slo_attainment < plain.slo_attainment  # a quarter out for each round
    assert np.min(in_place.ready) < np.min(plain.ready)
