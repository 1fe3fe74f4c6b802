"""Scaling policies, each a small object the simulators ask every control interval.

A policy sees an `Observation` (what a controller in the cluster could measure: ready
and provisioned replicas, the work that arrived over the last interval, requests in
flight) and returns the replica count it wants.

The reactive reference follows the Kubernetes HPA (autoscaling/v2) as documented in
"Horizontal Pod Autoscaling" (kubernetes.io, "Algorithm details" and "Configurable
scaling behavior"): every 15 s (``--horizontal-pod-autoscaler-sync-period``)
``desired = ceil(current * metric / target)``, where ``current`` is the scale target's
replica count (starting pods included); no change while ``metric / target`` is within
the 10% tolerance; scale-up without a stabilisation window and at most
max(+100%, +4 pods) per 15 s; scale-down to the *highest* recommendation of the last
300 s. The metric is read through a metrics pipeline (`MetricView`): the value the HPA
acts on is the mean over ``METRIC_WINDOW_S`` that ended ``METRIC_DELAY_S`` ago (one
scrape interval), not the instantaneous load. The metric itself is the offered work per
replica (the gateway's token rates as an External/AverageValue metric), which does not
saturate at 100% like a GPU-utilisation metric would: that makes the HPA a strong
reference, never a strawman.

- `Hpa`: the above on offered work against a target utilisation.
- `KedaQueue`: KEDA's Prometheus scaler on requests in flight (waiting + running), an
  AverageValue target per replica, then the same HPA rules.
- `Predictive`: the larger of the upper-quantile forecast over every bin that touches
  [now, now + lead time] and the measured work (the same delayed metric the HPA reads),
  divided by a target utilisation chosen on the training period. It has no tolerance,
  no scale-down window by default and no scale-up rate limit (it writes the scale
  subresource itself, as the operator will): the forecast already holds replicas for
  the whole lead time, so when it says demand falls the pool shrinks at once.
- `PredictiveWithFloor`: the larger of `Predictive` and the HPA at the same target:
  never fewer replicas than the reactive policy would run.
- `Oracle`: the true future work over [now, now + lead time] (what predictive would do
  with a perfect forecast): scales up exactly one lead time ahead, down immediately
  (or after a window, which `evaluate` chooses on the training part as for predictive:
  the future *arrivals* it knows say nothing of long prefills still queued).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridllm_forecaster.capacity import PoolConfig

HPA_TOLERANCE = 0.1
HPA_DOWN_WINDOW_S = 300.0  # behavior.scaleDown.stabilizationWindowSeconds default
METRIC_DELAY_S = 15.0  # one scrape interval between the load and the value the controller reads
METRIC_WINDOW_S = 30.0  # the metric is a rate over this window (two scrapes)


@dataclass(frozen=True)
class Observation:
    now_s: float
    ready: int
    provisioned: int  # ready + starting (draining replicas excluded)
    work_per_s: float  # offered work over the last interval, replica-seconds per second
    in_flight: float  # requests waiting or running


@dataclass
class MetricView:
    """The offered work as a controller reads it: averaged over a window, one delay late.

    The simulators feed the policies the load as it is offered, so this models the
    metrics pipeline between the two. A controller that reads a real metric (the
    operator: a Prometheus `rate()`, or a gateway's counters) already reads it late and
    averaged, and uses `live_view` instead.
    """

    delay_s: float = METRIC_DELAY_S
    window_s: float = METRIC_WINDOW_S
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def read(self, obs: Observation) -> float:
        self._samples.append((obs.now_s, obs.work_per_s))
        newest = obs.now_s - self.delay_s
        while len(self._samples) > 1 and self._samples[0][0] <= newest - self.window_s:
            self._samples.popleft()
        seen = [w for t, w in self._samples if t <= newest + 1e-9]
        # before the first delayed sample exists, the oldest one is the best there is
        return float(np.mean(seen)) if seen else self._samples[0][1]

    def state(self) -> list[list[float]]:
        return [[t, w] for t, w in self._samples]

    def restore(self, state: list[list[float]]) -> None:
        self._samples = deque((float(t), float(w)) for t, w in state)


def live_view() -> MetricView:
    """The metric as read, unchanged: for a real metric, which carries its own pipeline's
    delay and window (a second model of them would make the controller react late twice)."""
    return MetricView(delay_s=0.0, window_s=0.0)


@dataclass
class HpaBehaviour:
    """Tolerance, stabilisation and rate limits in the order autoscaling/v2 applies them.

    The recommendation (after the tolerance) is recorded; scale-down goes to the highest
    recommendation within ``down_window_s`` (scale-up has no window); then the scale-up
    rate limit max(+100%, +4 pods) per 15 s and the min/max bounds.
    """

    pool: PoolConfig
    apply_tolerance: bool = True
    down_window_s: float = HPA_DOWN_WINDOW_S
    limit_scale_up: bool = True
    _recent: deque[tuple[float, int]] = field(default_factory=deque)

    def apply(self, obs: Observation, raw_desired: float) -> int:
        current = obs.provisioned
        rec = math.ceil(raw_desired - 1e-9)
        if (
            self.apply_tolerance
            and current > 0
            and abs(raw_desired / current - 1.0) <= HPA_TOLERANCE
        ):
            rec = current
        rec = self._bound(rec)
        self._recent.append((obs.now_s, rec))
        while self._recent and self._recent[0][0] <= obs.now_s - self.down_window_s:
            self._recent.popleft()
        down = max(d for _, d in self._recent) if self._recent else rec
        if rec > current:
            desired = min(rec, max(2 * current, current + 4)) if self.limit_scale_up else rec
        elif down < current:
            desired = down
        else:
            desired = current
        return self._bound(desired)

    def _bound(self, n: int) -> int:
        return int(min(self.pool.max_replicas, max(self.pool.min_replicas, n)))

    def seed(self, now_s: float, replicas: int) -> None:
        """Count the replicas a pool starts with (or starts again with, its spec's starting
        point changed) as a recommendation made now, so that a controller does not take a
        pool below its starting size before one stabilisation window has passed (an HPA
        created beside a pool would, at once)."""
        self._recent.append((now_s, replicas))

    def state(self) -> list[list[float]]:
        return [[t, d] for t, d in self._recent]

    def restore(self, state: list[list[float]]) -> None:
        self._recent = deque((float(t), int(d)) for t, d in state)


class Policy:
    """Decides replicas from observations. Its memory (the metric pipeline's samples, the
    recent recommendations of the stabilisation window) is plain data that `state` gives
    and `restore` takes back, so a controller that restarts carries on where it was."""

    name = "policy"

    def decide(self, obs: Observation) -> int:
        raise NotImplementedError

    def state(self) -> dict[str, list[list[float]]]:
        return {}

    def restore(self, state: dict[str, list[list[float]]]) -> None:
        del state


class Hpa(Policy):
    name = "hpa"

    def __init__(
        self,
        pool: PoolConfig,
        target_utilisation: float = 0.7,
        metric: MetricView | None = None,
        *,
        down_window_s: float = HPA_DOWN_WINDOW_S,
    ) -> None:
        self.target = target_utilisation
        self.behaviour = HpaBehaviour(pool, down_window_s=down_window_s)
        self.metric = metric if metric is not None else MetricView()

    def decide(self, obs: Observation) -> int:
        work = self.metric.read(obs)
        if obs.ready == 0:
            return self.behaviour.apply(obs, max(obs.provisioned, 1))
        return self.behaviour.apply(obs, work / self.target)

    def state(self) -> dict[str, list[list[float]]]:
        return {"metric": self.metric.state(), "recent": self.behaviour.state()}

    def restore(self, state: dict[str, list[list[float]]]) -> None:
        self.metric.restore(state.get("metric", []))
        self.behaviour.restore(state.get("recent", []))


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
        self,
        pool: PoolConfig,
        forecast_max: ForecastFn,
        target_utilisation: float | None = None,
        *,
        down_window_s: float = 0.0,
        metric: MetricView | None = None,
    ) -> None:
        self.pool = pool
        self.forecast_max = forecast_max
        self.target = target_utilisation or pool.target_utilisation
        self.behaviour = HpaBehaviour(
            pool, apply_tolerance=False, down_window_s=down_window_s, limit_scale_up=False
        )
        self.metric = metric  # None: plan from the forecast alone (the oracle)

    def decide(self, obs: Observation) -> int:
        work = self.forecast_max(obs.now_s, obs.now_s + self.pool.lead_time_s)
        if self.metric is not None:
            work = max(work, self.metric.read(obs))
        return self.behaviour.apply(obs, work / self.target)

    def state(self) -> dict[str, list[list[float]]]:
        out = {"recent": self.behaviour.state()}
        if self.metric is not None:
            out["metric"] = self.metric.state()
        return out

    def restore(self, state: dict[str, list[list[float]]]) -> None:
        self.behaviour.restore(state.get("recent", []))
        if self.metric is not None:
            self.metric.restore(state.get("metric", []))


class PredictiveWithFloor(Policy):
    name = "predictive+floor"

    def __init__(
        self,
        pool: PoolConfig,
        forecast_max: ForecastFn,
        target_utilisation: float | None = None,
        *,
        down_window_s: float = 0.0,
        floor_down_window_s: float = HPA_DOWN_WINDOW_S,
        view: Callable[[], MetricView] = MetricView,
    ) -> None:
        target = target_utilisation or pool.target_utilisation
        self.predictive = Predictive(
            pool, forecast_max, target, down_window_s=down_window_s, metric=view()
        )
        self.floor = Hpa(pool, target, view(), down_window_s=floor_down_window_s)
        self.last: tuple[int, int] | None = None  # (predictive, reactive) of the last decision

    def decide(self, obs: Observation) -> int:
        self.last = (self.predictive.decide(obs), self.floor.decide(obs))
        return max(self.last)

    def state(self) -> dict[str, list[list[float]]]:
        inner = {f"predictive.{k}": v for k, v in self.predictive.state().items()}
        return inner | {f"floor.{k}": v for k, v in self.floor.state().items()}

    def restore(self, state: dict[str, list[list[float]]]) -> None:
        for prefix, policy in (("predictive.", self.predictive), ("floor.", self.floor)):
            policy.restore({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


class Fixed(Policy):
    """A pool of a fixed size: what `evaluate` checks reachability of the SLO with."""

    name = "fixed"

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, obs: Observation) -> int:
        del obs
        return self.replicas


class Oracle(Policy):
    name = "oracle"

    def __init__(
        self,
        pool: PoolConfig,
        true_max: ForecastFn,
        target_utilisation: float | None = None,
        *,
        down_window_s: float = 0.0,
    ) -> None:
        self.inner = Predictive(pool, true_max, target_utilisation, down_window_s=down_window_s)

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


def forecast_max_fn(
    upper: np.ndarray, bin_s: float, offset_s: float = 0.0, observed_after_s: float | None = None
) -> ForecastFn:
    """Max of the upper forecast over the bins after the current one that touch [from, to].

    `upper[i, h - 1]` forecasts bin ``i + h`` from the data up to bin ``i``; times are
    simulation seconds, bin ``k`` starts at ``offset_s + k * bin_s``. A bin counts as
    observed ``observed_after_s`` after it starts (default: when it is complete). The
    fluid simulator holds a bin's rate constant, so there the rate of the current bin is
    known after one metric reading, exactly as the HPA knows it; the forecast is then
    issued from the current bin. Returns 0 when [from, to] ends within an observed bin:
    the measured work (the caller's floor) covers it.
    """
    n, horizon = upper.shape
    seen_after = bin_s if observed_after_s is None else min(observed_after_s, bin_s)

    def fn(from_s: float, to_s: float) -> float:
        rel = from_s - offset_s
        cur = int(rel // bin_s)  # the bin that holds now
        origin = cur if rel - cur * bin_s >= seen_after - 1e-9 else cur - 1
        if origin < 0:
            return float(np.max(upper[0]))
        origin = min(origin, n - 1)
        last_bin = int((to_s - offset_s) // bin_s)
        first_h = max(1, cur - origin)
        h_max = min(horizon, last_bin - origin)
        if h_max < first_h:
            return 0.0
        return float(np.max(upper[origin, first_h - 1 : h_max]))

    return fn
