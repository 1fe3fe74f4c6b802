from __future__ import annotations

import numpy as np

from hybridllm_forecaster import planner, policies
from hybridllm_forecaster.capacity import PoolConfig
from hybridllm_forecaster.stream import DemandSeries

POOL = PoolConfig(min_replicas=1, max_replicas=50)


def obs(now: float, replicas: int, work: float, in_flight: float = 0.0) -> policies.Observation:
    return policies.Observation(now, replicas, replicas, work, in_flight)


def test_hpa_tolerance_scale_up_limit_and_stabilisation():
    hpa = policies.Hpa(POOL, 0.5)
    assert hpa.decide(obs(0, 10, 5.2)) == 10  # 10.4 wanted: within the 10% tolerance
    assert hpa.decide(obs(15, 10, 6.0)) == 12
    assert policies.Hpa(POOL, 0.5).decide(obs(0, 2, 20.0)) == 6  # max(+100%, +4 pods)
    assert hpa.decide(obs(30, 12, 1.0)) == 12  # scale-down waits for the window
    assert hpa.decide(obs(15 + 299, 12, 1.0)) == 12  # the 12 of t=15 is still in the window
    assert hpa.decide(obs(15 + 301, 12, 1.0)) == 2


def test_keda_scales_on_requests_in_flight():
    keda = policies.KedaQueue(POOL, target_in_flight=10)
    assert keda.decide(obs(0, 2, 0.0, in_flight=60)) == 6


def test_predictive_uses_the_forecast_and_floor_catches_misses():
    low = policies.Predictive(POOL, lambda a, b: 4.0, 0.8)
    assert low.decide(obs(0, 3, 100.0)) == 5  # trusts the forecast (4 / 0.8)
    floored = policies.PredictiveWithFloor(POOL, lambda a, b: 4.0, 0.8)
    assert floored.decide(obs(0, 3, 10.0)) == 7  # the HPA floor: 12.5 wanted, capped at 3 + 4


def test_forecast_max_fn_reads_the_right_origin():
    upper = np.arange(20, dtype=float)[:, None] * 10 + np.array([[1.0, 2.0]])
    fn = policies.forecast_max_fn(upper, bin_s=60.0)
    assert fn(130.0, 150.0) == 11.0  # at 130 s, the last complete bin is 1: its h=1 forecast
    assert fn(130.0, 190.0) == 12.0  # the lead time reaches bin 3: h=2


def _history(rate: float, bins: int = 48) -> DemandSeries:
    r = np.full(bins, rate)
    return DemandSeries(300.0, r, r * 1500, r * 300)


def test_plan_replicas_follows_demand_and_stabilises():
    p1 = planner.plan_replicas(_history(100.0), POOL, now_s=0.0)
    p2 = planner.plan_replicas(_history(200.0), POOL, now_s=15.0)
    assert p2.desired > p1.desired >= POOL.min_replicas
    high = planner.plan_replicas(_history(200.0), POOL, now_s=0.0)
    low = planner.plan_replicas(_history(50.0), POOL, now_s=100.0, state=high.state)
    assert low.raw_desired < high.desired
    assert low.desired == high.desired  # held by scale-down stabilisation
    later = planner.plan_replicas(_history(50.0), POOL, now_s=400.0, state=low.state)
    assert later.desired == later.raw_desired < high.desired
