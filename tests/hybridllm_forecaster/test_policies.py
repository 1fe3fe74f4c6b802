from __future__ import annotations

import numpy as np

from hybridllm_forecaster import planner, policies
from hybridllm_forecaster.capacity import PoolConfig
from hybridllm_forecaster.stream import DemandSeries

POOL = PoolConfig(min_replicas=1, max_replicas=50)


def obs(now: float, replicas: int, work: float, in_flight: float = 0.0) -> policies.Observation:
    return policies.Observation(now, replicas, replicas, work, in_flight)


def instant() -> policies.MetricView:
    return policies.MetricView(delay_s=0.0, window_s=0.0)


def test_hpa_tolerance_scale_up_limit_and_stabilisation():
    hpa = policies.Hpa(POOL, 0.5, metric=instant())
    assert hpa.decide(obs(0, 10, 5.2)) == 10  # 10.4 wanted: within the 10% tolerance
    assert hpa.decide(obs(15, 10, 6.0)) == 12
    assert policies.Hpa(POOL, 0.5, metric=instant()).decide(obs(0, 2, 20.0)) == 6  # +4 pods
    assert hpa.decide(obs(30, 12, 1.0)) == 12  # scale-down waits for the window
    assert hpa.decide(obs(15 + 299, 12, 1.0)) == 12  # the 12 of t=15 is still in the window
    assert hpa.decide(obs(15 + 301, 12, 1.0)) == 2


def test_hpa_scale_down_takes_the_highest_recommendation_of_the_window():
    hpa = policies.Hpa(POOL, 0.5, metric=instant())
    assert hpa.decide(obs(0, 20, 10.0)) == 20
    assert hpa.decide(obs(100, 20, 6.0)) == 20  # 12 recommended, 20 still in the window
    assert hpa.decide(obs(200, 20, 3.0)) == 20
    assert hpa.decide(obs(301, 20, 3.0)) == 12  # t=0 left the window: max(12, 6, 6)
    assert hpa.decide(obs(401, 12, 3.0)) == 6
    assert hpa.decide(obs(402, 6, 5.0)) == 10  # scale-up has no window


def test_hpa_reads_the_metric_one_scrape_late():
    hpa = policies.Hpa(POOL, 0.5)  # 15 s delay, 30 s window
    for t in range(0, 61, 15):
        assert hpa.decide(obs(t, 4, 2.0)) == 4
    assert hpa.decide(obs(75, 4, 8.0)) == 4  # the jump at 75 s is not visible yet
    assert hpa.decide(obs(90, 4, 8.0)) == 8  # mean of 2 and 8 over the window: 5 / 0.5 = 10
    assert hpa.decide(obs(105, 8, 8.0)) == 16


def test_keda_scales_on_requests_in_flight():
    keda = policies.KedaQueue(POOL, target_in_flight=10)
    assert keda.decide(obs(0, 2, 0.0, in_flight=60)) == 6


def test_predictive_uses_the_forecast_and_floor_catches_misses():
    low = policies.Predictive(POOL, lambda a, b: 4.0, 0.8)
    assert low.decide(obs(0, 3, 100.0)) == 5  # no metric: trusts the forecast (4 / 0.8)
    measured = policies.Predictive(POOL, lambda a, b: 4.0, 0.8, metric=instant())
    assert measured.decide(obs(0, 3, 8.0)) == 10  # the measured 8 / 0.8, no HPA rate limit
    floored = policies.PredictiveWithFloor(POOL, lambda a, b: 4.0, 0.8)
    assert floored.decide(obs(0, 3, 10.0)) == 13  # 10 / 0.8 at once (the HPA alone: 3 + 4)


def test_predictive_scales_down_when_the_forecast_falls():
    ahead = {"work": 16.0}
    pred = policies.Predictive(POOL, lambda a, b: ahead["work"], 0.8)
    hpa = policies.Hpa(POOL, 0.8, metric=instant())
    assert pred.decide(obs(0, 20, 16.0)) == hpa.decide(obs(0, 20, 16.0)) == 20
    ahead["work"] = 4.0
    assert pred.decide(obs(15, 20, 4.0)) == 5  # at once
    assert hpa.decide(obs(15, 20, 4.0)) == 20  # held for 300 s


def test_forecast_max_fn_reads_the_right_origin():
    upper = np.arange(20, dtype=float)[:, None] * 10 + np.array([[1.0, 2.0]])
    fn = policies.forecast_max_fn(upper, bin_s=60.0)
    assert fn(130.0, 150.0) == 11.0  # at 130 s, the last complete bin is 1: its h=1 forecast
    assert fn(130.0, 190.0) == 12.0  # the lead time reaches bin 3: h=2


def test_forecast_max_fn_uses_the_current_bin_once_it_is_observed():
    upper = np.arange(20, dtype=float)[:, None] * 10 + np.array([[1.0, 2.0]])
    fn = policies.forecast_max_fn(upper, bin_s=60.0, observed_after_s=30.0)
    assert fn(125.0, 150.0) == 11.0  # 5 s into bin 2: not observed yet, origin 1
    assert fn(150.0, 170.0) == 0.0  # bin 2 observed and the lead ends in it: nothing ahead
    assert fn(150.0, 190.0) == 21.0  # origin 2, bin 3 ahead: its h=1 forecast
    assert fn(150.0, 250.0) == 22.0  # and bin 4: h=2


def _history(rate: float, bins: int = 48) -> DemandSeries:
    r = np.full(bins, rate)
    return DemandSeries(300.0, r, r * 1500, r * 300)


def test_plan_replicas_follows_demand_and_stabilises():
    p1 = planner.plan_replicas(_history(80.0), POOL, now_s=0.0)  # 43 replicas, under the 50
    p2 = planner.plan_replicas(_history(200.0), POOL, now_s=15.0)
    assert p2.desired > p1.desired >= POOL.min_replicas
    held = POOL.with_(forecast_down_window_s=300.0)
    high = planner.plan_replicas(_history(200.0), held, now_s=0.0)
    low = planner.plan_replicas(_history(50.0), held, now_s=100.0, state=high.state)
    assert low.raw_desired < high.desired
    assert low.desired == high.desired  # held by scale-down stabilisation
    later = planner.plan_replicas(_history(50.0), held, now_s=400.0, state=low.state)
    assert later.desired == later.raw_desired < high.desired


def test_plan_replicas_scales_down_at_once_by_default():
    high = planner.plan_replicas(_history(200.0), POOL, now_s=0.0)
    low = planner.plan_replicas(_history(50.0), POOL, now_s=15.0, state=high.state)
    assert low.desired == low.raw_desired < high.desired
    assert low.desired >= POOL.replicas_for(low.measured_work_per_s)  # never below the floor
