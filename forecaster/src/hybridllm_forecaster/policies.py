"""Scaling policies, each a small object the simulators ask every control interval.

A policy sees an `Observation` (what a controller in the cluster could measure: ready
and provisioned replicas, the work that arrived over the last interval, requests in
flight) and returns the replica count it wants. All of them share `HpaBehaviour`, the
Kubernetes HPA's own rules, so they differ only in the signal:

- `Hpa`: the HPA algorithm on offered load per ready replica against a target
  utilisation: no change within a 10% tolerance, scale-up limited to max(+100%, +4
  pods) per 15 s, scale-down to the highest recommendation of the last 300 s.
- `KedaQueue`: KEDA's Prometheus scaler on requests in flight (waiting + running), an
  AverageValue target per replica, then the same HPA rules.
- `Predictive`: the upper-quantile forecast of work over the next lead time, divided by
  the target utilisation (`capacity.PoolConfig.replicas_for`).
- `PredictiveWithFloor`: the larger of `Predictive` and the HPA at the same target:
  never fewer replicas than the reactive policy would run, more where the forecast
  sees a rise coming that the HPA would only notice once it has happened.
- `Oracle`: the true future work over the lead time (what predictive would do with a
  perfect forecast).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridllm_forecaster.capacity import PoolConfig

HPA_TOLERANCE = 0.1


@dataclass(frozen=True)
class Observation:
    now_s: float
    ready: int
    provisioned: int  # ready + starting (draining replicas excluded)
    work_per_s: float  # offered work over the last interval, replica-seconds per second
    in_flight: float  # requests waiting or running


@dataclass
class HpaBehaviour:
    """Tolerance, scale-up rate limit and scale-down stabilisation, as autoscaling/v2 does."""

    pool: PoolConfig
    apply_tolerance: bool = True
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    def apply(self, obs: Observation, raw_desired: float) -> int:
        current = max(obs.provisioned, 1)
        desired = math.ceil(raw_desired - 1e-9)
        if self.apply_tolerance and abs(raw_desired / current - 1.0) <= HPA_TOLERANCE:
            desired = obs.provisioned
        desired = min(desired, max(2 * current, current + 4))
        desired = int(min(self.pool.max_replicas, max(self.pool.min_replicas, desired)))
        window = self.pool.scale_down_stabilisation_s
        self._recent.append((obs.now_s, desired))
        while self._recent and self._recent[0][0] <= obs.now_s - window:
            self._recent.popleft()
        return max(d for _, d in self._recent)


class Policy:
    name = "policy"

    def decide(self, obs: Observation) -> int:
        raise NotImplementedError


class Hpa(Policy):
    name = "hpa"

    def __init__(self, pool: PoolConfig, target_utilisation: float = 0.7) -> None:
        self.target = target_utilisation
        self.behaviour = HpaBehaviour(pool)

    def decide(self, obs: Observation) -> int:
        if obs.ready == 0:
            return self.behaviour.apply(obs, max(obs.provisioned, 1))
        return self.behaviour.apply(obs, obs.work_per_s / self.target)


class KedaQueue(Policy):
    name = "keda-queue"

    def __init__(self, pool: PoolConfig, target_in_flight: float | None = None) -> None:
        self.target = target_in_flight or 0.7 * pool.max_batch
        self.behaviour = HpaBehaviour(pool)

    def decide(self, obs: Observation) -> int:
        return self.behaviour.apply(obs, obs.in_flight / self.target)


ForecastFn = Callable[[float, float], float]  # (from_s, to_s) -> work per second to plan for


class Predictive(Policy):
    name = "predictive"

    def __init__(
        self, pool: PoolConfig, forecast_max: ForecastFn, target_utilisation: float | None = None
    ) -> None:
        self.pool = pool
        self.forecast_max = forecast_max
        self.target = target_utilisation or pool.target_utilisation
        self.behaviour = HpaBehaviour(pool, apply_tolerance=False)

    def decide(self, obs: Observation) -> int:
        work = self.forecast_max(obs.now_s, obs.now_s + self.pool.lead_time_s)
        return self.behaviour.apply(obs, self.pool.replicas_for(work, self.target))


class PredictiveWithFloor(Policy):
    name = "predictive+floor"

    def __init__(
        self, pool: PoolConfig, forecast_max: ForecastFn, target_utilisation: float | None = None
    ) -> None:
        self.predictive = Predictive(pool, forecast_max, target_utilisation)
        self.floor = Hpa(pool, target_utilisation or pool.target_utilisation)

    def decide(self, obs: Observation) -> int:
        return max(self.predictive.decide(obs), self.floor.decide(obs))


class Oracle(Policy):
    name = "oracle"

    def __init__(
        self, pool: PoolConfig, true_max: ForecastFn, target_utilisation: float | None = None
    ) -> None:
        self.inner = Predictive(pool, true_max, target_utilisation)

    def decide(self, obs: Observation) -> int:
        return self.inner.decide(obs)


def series_max_fn(values: np.ndarray, step_s: float) -> ForecastFn:
    """Max of a step-indexed series over [from_s, to_s] (the oracle's view of the future)."""
    n = len(values)

    def fn(from_s: float, to_s: float) -> float:
        a = min(n - 1, max(0, int(from_s // step_s)))
        b = min(n, max(a + 1, math.ceil(to_s / step_s)))
        return float(np.max(values[a:b]))

    return fn


def forecast_max_fn(upper: np.ndarray, bin_s: float, offset_s: float = 0.0) -> ForecastFn:
    """Max of the upper forecast issued at the last complete bin over bins touching [from, to].

    `upper[i, h - 1]` forecasts bin ``i + h`` from the data up to bin ``i``; times are
    simulation seconds, bin ``k`` starts at ``offset_s + k * bin_s``.
    """
    n, horizon = upper.shape

    def fn(from_s: float, to_s: float) -> float:
        origin = int((from_s - offset_s) // bin_s) - 1  # last bin fully observed
        if origin < 0:
            return float(np.max(upper[0]))
        origin = min(origin, n - 1)
        last_bin = int((to_s - offset_s) // bin_s)
        h_max = min(horizon, max(1, last_bin - origin))
        return float(np.max(upper[origin, :h_max]))

    return fn
