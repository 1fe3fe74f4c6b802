"""The online autoscaler of one pool: what the operator and local mode run every interval.

It is a thin shell around the simulator's policies (`hybridllm_forecaster.policies`):
the decision itself is `Hpa.decide` (reactive), `Predictive.decide` (predictive) or
`PredictiveWithFloor.decide` (hybrid: the larger of the two), the very objects
``hybridllm forecast eval`` simulates. The shell adds only what a controller in a real
cluster needs around them:

- **the forecast**, from the pool's demand history in bins (`OnlineForecast`): the
  forecaster's `run_model` over the bins seen so far, read through the simulator's own
  `forecast_max_fn` (issued from the last complete bin);
- **missing metrics hold**: no reading (no series yet, a NaN, a failed scrape) keeps the
  replicas where they are and says so; the policies never see a made-up zero;
- **an SLO guard**: no scale-down while the pool's latency SLO is violated;
- **capacity**: a pool whose new pods cannot be scheduled is not scaled further up;
- **modes**: ``advisory`` computes the hybrid decision and applies nothing; ``external``
  and ``off`` leave replicas alone (an HPA or the spec owns them);
- **state**: everything the policies remember is plain data (`PoolScaler.state`), which
  the operator keeps on the LLMService, so a restarted operator carries on.

Time is whatever clock the caller passes in (seconds), so tests replay a trace on a fake
clock and compare with the simulator decision by decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hybridllm_forecaster import forecast, policies
from hybridllm_forecaster.capacity import PoolConfig

Mode = Literal["off", "reactive", "predictive", "hybrid", "advisory", "external"]
MODES: tuple[Mode, ...] = ("off", "reactive", "predictive", "hybrid", "advisory", "external")
# Modes in which the autoscaler decides; of those, all but advisory also apply.
DECIDING: frozenset[str] = frozenset({"reactive", "predictive", "hybrid", "advisory"})
APPLYING: frozenset[str] = frozenset({"reactive", "predictive", "hybrid"})

MIN_FORECAST_BINS = 4  # below this, predictive plans from the measured load alone
ERROR_BINS = 12  # the forecast's recent error: WAPE of the one-bin-ahead median over these


@dataclass(frozen=True)
class Reading:
    """One pool's load, as the metrics pipeline gives it at one control interval.

    ``work_per_s`` is None when there is no trustworthy value (the series does not exist
    yet, a NaN, a failed scrape): the autoscaler then holds. Zero is a real reading.
    """

    work_per_s: float | None
    in_flight: float = 0.0
    slo_violation: str | None = None  # e.g. "p95 TTFT 3.1 s > 1.0 s"; None: met or unknown
    waiting: float = 0.0  # requests held (or turned away) for want of a replica
    overloaded: float = 0.0  # requests the pool's tier answered 503 (overloaded) in the window
    # attempts on the pool's replicas that sent no first byte within the gateway's timeout:
    # a pool so far behind that its requests time out shows no TTFT (none finish) and no 503
    timed_out: float = 0.0

    @property
    def available(self) -> bool:
        return self.work_per_s is not None and math.isfinite(self.work_per_s)

    @property
    def saturation(self) -> list[str]:
        """The signals that the pool is short of replicas whatever its token rate says:
        its time to first token breaks the SLO, it turns requests away, or they time out."""
        signals = [self.slo_violation] if self.slo_violation else []
        if self.overloaded > 0:
            signals.append(f"{self.overloaded:g} request(s) answered 503 (overloaded)")
        if self.timed_out > 0:
            signals.append(f"{self.timed_out:g} attempt(s) timed out before a first byte")
        return signals


@dataclass
class OnlineForecast:
    """The forecast of one pool's work (replica-seconds per second) from its history.

    ``update`` takes the complete bins known so far (the metrics source keeps them: a
    Prometheus range query, or the bins a direct scrape accumulated); the model runs again
    when a new bin arrives. ``forecast_max`` is the simulator's `forecast_max_fn` over
    the result, so a bin counts once complete, as on request traces.
    """

    bin_s: float
    horizon: int
    model: str = "holt-winters"
    upper_q: float = 0.9
    refit_every: int = 60
    season_s: float = forecast.DAY_S  # the period the seasonal model learns
    start_s: float = 0.0  # when bin 0 of the history began
    _bins: int = 0
    _fc: forecast.Forecast | None = None
    _fn: policies.ForecastFn | None = None
    _y: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def for_pool(
        cls,
        pool: PoolConfig,
        bin_s: float,
        model: str = "holt-winters",
        season_s: float = forecast.DAY_S,
    ) -> OnlineForecast:
        horizon = max(1, math.ceil(pool.lead_time_s / bin_s)) + 1
        return cls(bin_s=bin_s, horizon=horizon, model=model, season_s=season_s)

    def spec(self) -> forecast.ForecastSpec:
        """The same for every history length, so that the forecast from a bin never changes
        as later bins arrive (what the simulator's rolling forecast assumes)."""
        return forecast.ForecastSpec(
            bin_s=self.bin_s, horizon=self.horizon, upper_q=self.upper_q,
            refit_every=self.refit_every, season_s=self.season_s,
        )  # fmt: skip

    def update(self, bins: Sequence[float], start_s: float) -> None:
        """The complete bins of the history, oldest first; bin 0 began at ``start_s``."""
        y = np.maximum(np.nan_to_num(np.asarray(bins, dtype=float), nan=0.0), 0.0)
        if len(y) == self._bins and start_s == self.start_s and np.array_equal(y, self._y):
            return
        self._bins, self.start_s, self._y = len(y), start_s, y
        if len(y) < MIN_FORECAST_BINS:
            self._fc = self._fn = None
            return
        self._fc = forecast.run_model(self.model, y, self.spec())
        self._fn = policies.forecast_max_fn(self._fc.upper, self.bin_s, start_s, self.bin_s)

    def history(self) -> tuple[np.ndarray, float]:
        """The bins last given to `update`, and when bin 0 began."""
        return self._y, self.start_s

    @property
    def ready(self) -> bool:
        return self._fn is not None

    @property
    def num_bins(self) -> int:
        return self._bins

    def stale_bins(self, now_s: float) -> int:
        """Bins missing between the history's end and the bin that holds ``now_s``: 0 when
        the history is current (a late or broken metrics source, or a clock mismatch,
        shows here: beyond the horizon the forecast reaches no further than now)."""
        if self._fn is None:
            return 0
        return max(0, int((now_s - self.start_s) // self.bin_s) - self._bins)

    def forecast_max(self, from_s: float, to_s: float) -> float:
        return self._fn(from_s, to_s) if self._fn is not None else 0.0

    def latest(self) -> tuple[float, float] | None:
        """The largest P50 and upper forecast over the horizon from the last complete bin."""
        if self._fc is None:
            return None
        return float(np.max(self._fc.p50[-1])), float(np.max(self._fc.upper[-1]))

    def recent_error(self) -> float | None:
        """WAPE of the one-bin-ahead median forecast over the last complete bins."""
        if self._fc is None or self._bins < 2:
            return None
        k = min(ERROR_BINS, self._bins - 1)
        actual = self._y[-k:]
        predicted = self._fc.p50[-k - 1 : -1, 0]
        total = float(np.sum(np.abs(actual)))
        return float(np.sum(np.abs(actual - predicted))) / total if total > 0 else None


@dataclass(frozen=True)
class Decision:
    """What the autoscaler decided for one pool at one interval, and why."""

    desired: int  # replicas to run (the current count when it holds or does not apply)
    recommended: int | None  # what the policy wanted (None when it did not decide)
    reactive: int | None  # the reactive policy's part (reactive and hybrid modes)
    predictive: int | None  # the predictive policy's part (predictive and hybrid modes)
    predicted_p50: float | None  # forecast work over the lead time, in replicas at target
    predicted_p90: float | None
    forecast_error: float | None
    reason: str
    metrics_available: bool
    capacity_bound: bool = False
    budget_bound: bool = False  # the service's GPU budget cut its scale-up
    # The reason in a few fixed words, without its numbers (e.g. "scale up: forecast"):
    # a metric label whose values stay few, where the reason would make a new series at
    # every decision.
    cause: str = "hold"


def fit_budget(
    want: Mapping[str, int],
    current: Mapping[str, int],
    low: Mapping[str, int],
    gpus: Mapping[str, int],
    budget: int,
) -> dict[str, int]:
    """Replicas per pool within a GPU budget (each pool's replicas times its ``gpus``,
    summed). Every cut a pool wants is kept; its rise is granted one replica at a time to
    the pool furthest below what it wants (as a share of it), while the next replica's
    GPUs fit. Pools above the budget already (it was lowered) give back replicas, the pool
    holding most GPUs first, down to ``low``. A pool without GPUs gets what it wants."""
    alloc = {c: min(want[c], current.get(c, want[c])) for c in want}

    def used() -> int:
        return sum(alloc[c] * gpus.get(c, 0) for c in alloc)

    while used() > budget:
        over = [c for c in alloc if gpus.get(c, 0) and alloc[c] > low.get(c, 0)]
        if not over:
            break
        alloc[max(over, key=lambda c: (alloc[c] * gpus[c], c))] -= 1
    while True:
        room = budget - used()
        short = [
            c for c in alloc
            if alloc[c] < want[c] and (not gpus.get(c, 0) or gpus[c] <= room)
        ]  # fmt: skip
        if not short:
            return alloc
        alloc[min(short, key=lambda c: (alloc[c] / want[c], c))] += 1


class PoolScaler:
    """One pool's autoscaler: a policy of the simulator plus the controller's guards."""

    def __init__(
        self,
        pool: PoolConfig,
        mode: Mode,
        fc: OnlineForecast,
        view: Callable[[], policies.MetricView] = policies.live_view,
    ) -> None:
        """``view``: how the policies read the demand they are given. Online it is a real
        metric, read as it is (`policies.live_view`); a replay of the simulator's
        observations passes the simulator's model of the metrics pipeline
        (`policies.MetricView`) to take the simulator's decisions."""
        if mode not in MODES:
            raise ValueError(f"unknown autoscaling mode {mode!r}; expected one of {MODES}")
        self.pool, self.mode, self.forecast = pool, mode, fc
        target = pool.target_utilisation
        self.policy: policies.Policy | None
        if mode == "reactive":
            self.policy = policies.Hpa(
                pool, target, view(), down_window_s=pool.scale_down_stabilisation_s
            )
        elif mode == "predictive":
            self.policy = policies.Predictive(
                pool, fc.forecast_max, target, down_window_s=pool.forecast_down_window_s,
                metric=view(),
            )  # fmt: skip
        elif mode in ("hybrid", "advisory"):
            self.policy = policies.PredictiveWithFloor(
                pool, fc.forecast_max, target, down_window_s=pool.forecast_down_window_s,
                floor_down_window_s=pool.scale_down_stabilisation_s, view=view,
            )  # fmt: skip
        else:
            self.policy = None
        self._started = False  # the first decision seeds the reactive window
        # Raised for saturation: (replicas, until when they hold). A saturated pool is
        # scaled up whatever the token rate says; once it is not, it keeps that size for
        # one scale-down window (no flapping), then the policy decides again.
        self._raised: tuple[int, float] | None = None

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "policy": self.policy.state() if self.policy else {}}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take back a saved state; one saved under another mode is ignored."""
        if state and state.get("mode") == self.mode and self.policy is not None:
            self.policy.restore(state.get("policy") or {})
            self._started = True

    def start_again(self) -> None:
        """The pool starts again from the replicas it runs (its spec's starting point was
        changed): the next decision seeds the reactive window with them, as the first did."""
        self._started = False

    # ------------------------------------------------------------------ the decision

    def decide(
        self,
        now_s: float,
        ready: int,
        provisioned: int,
        reading: Reading,
        *,
        unschedulable: int = 0,
        bound: str = "",
    ) -> Decision:
        """Replicas for the pool from now on.

        ``provisioned`` is the replica count the pool runs now (ready and starting pods:
        the Deployment's replicas); ``ready`` those that serve; ``unschedulable`` the
        pods that the scheduler cannot place; ``bound`` why one more replica could not
        run, known before trying ("": it could, or it is not known).
        """
        predicted = self._predicted()
        error = self.forecast.recent_error()
        common: dict[str, Any] = dict(
            predicted_p50=predicted[0] if predicted else None,
            predicted_p90=predicted[1] if predicted else None,
            forecast_error=error,
        )
        if self.policy is None:
            reason = (
                "autoscaling is external: replicas are left to the HPA or KEDA that owns them"
                if self.mode == "external"
                else "autoscaling is off: replicas come from the spec"
            )
            return Decision(provisioned, None, None, None, reason=reason,
                            metrics_available=reading.available, cause=f"hold: {self.mode}",
                            **common)  # fmt: skip
        if not reading.available:
            return Decision(
                provisioned, None, None, None,
                reason="holding: no load metric for this pool (no samples yet, a NaN or a "
                "failed scrape); replicas stay until one arrives",
                metrics_available=False, cause="hold: no load metric", **common,
            )  # fmt: skip
        assert reading.work_per_s is not None
        if not self._started:
            # The replicas the pool starts with hold for one reactive window (unless the
            # load needs more); the forecast's own part has no window to seed.
            self._started = True
            floor = (
                self.policy.floor if isinstance(self.policy, policies.PredictiveWithFloor)
                else self.policy
            )  # fmt: skip
            if isinstance(floor, policies.Hpa):
                floor.behaviour.seed(now_s, provisioned)
        if provisioned == 0:
            # At zero, the policies have nothing to measure (no replica, no load served):
            # the pool wakes on requests waiting for it, and otherwise stays down.
            want = 1 if reading.waiting > 0 or reading.work_per_s > 0 else 0
            want = min(max(want, self.pool.min_replicas), self.pool.max_replicas)
            why = (
                f"scale from zero to {want}: {reading.waiting:g} request(s) waiting for a replica"
                if want
                else "at zero replicas: no request is waiting"
            )
            if want and (unschedulable > 0 or bound):
                return Decision(0, want, None, None, reason=(
                    f"capacity-bound: {bound or f'{unschedulable} pod(s) cannot be scheduled'}"
                    f", so the pool stays at 0 (wanted {want})"
                ), metrics_available=True, capacity_bound=True, cause="hold: capacity-bound",
                    **common)  # fmt: skip
            cause = "scale up: requests waiting" if want else "hold: no request waiting"
            if self.mode == "advisory":
                return Decision(0, want, None, None, reason=f"advisory, not applied: {why}",
                                metrics_available=True, cause=f"advisory, {cause}",
                                **common)  # fmt: skip
            return Decision(want, want, None, None, reason=why, metrics_available=True,
                            cause=cause, **common)  # fmt: skip
        obs = policies.Observation(
            now_s, ready, provisioned, float(reading.work_per_s), reading.in_flight
        )
        recommended = self.policy.decide(obs)
        reactive, predictive = self._parts(recommended)
        reason, cause = self._explain(recommended, provisioned, reactive, predictive, now_s)
        desired = recommended
        bound_now, bound = bound, False  # why it cannot grow (the argument); whether it did not
        if recommended > provisioned and (unschedulable > 0 or bound_now):
            desired, bound = provisioned, True
            why = bound_now or f"{unschedulable} pod(s) cannot be scheduled"
            reason = (
                f"capacity-bound: {why}, so the pool is not scaled beyond {provisioned} "
                f"(wanted {recommended})"
            )
            cause = "hold: capacity-bound"
        elif (signals := reading.saturation) and recommended <= provisioned:
            desired, reason, cause, bound = self._saturated(
                ready, provisioned, recommended, signals, unschedulable, bound_now, now_s
            )
        elif self._raised is not None and recommended < self._raised[0]:
            raised, until = self._raised
            if now_s < until and provisioned >= raised:
                desired = provisioned
                reason = (
                    f"holding at {provisioned} (wanted {recommended}) until the scale-down "
                    f"window after saturation ends in {until - now_s:.0f} s"
                )
                cause = "hold: after saturation"
            else:
                self._raised = None
        if self.mode == "advisory":
            reason = f"advisory, not applied: {reason}"
            cause = f"advisory, {cause}"
            desired = provisioned
        return Decision(desired, recommended, reactive, predictive, reason=reason,
                        metrics_available=True, capacity_bound=bound, cause=cause,
                        **common)  # fmt: skip

    def _saturated(
        self,
        ready: int,
        provisioned: int,
        recommended: int,
        signals: list[str],
        unschedulable: int,
        bound: str,
        now_s: float,
    ) -> tuple[int, str, str, bool]:
        """A saturated pool that the policy would hold or shrink: one replica more, or the
        reason it cannot have one (at maxReplicas, or capacity-bound), or none while the last
        one added is still starting (its effect is not measured yet). The scale-down window
        after saturation counts from its last interval."""
        why = "; ".join(signals)
        until = now_s + self.pool.scale_down_stabilisation_s
        self._raised = (max(provisioned, self._raised[0] if self._raised else 0), until)
        if provisioned >= self.pool.max_replicas:
            return (
                provisioned,
                f"holding at maxReplicas {self.pool.max_replicas} while saturated ({why}); "
                f"raise maxReplicas to serve this load",
                "hold: saturated at maxReplicas",
                False,
            )
        if unschedulable > 0 or bound:
            return (
                provisioned,
                f"capacity-bound while saturated ({why}): "
                f"{bound or f'{unschedulable} pod(s) cannot be scheduled'}, so the pool stays "
                f"at {provisioned}",
                "hold: capacity-bound",
                True,
            )
        if ready < provisioned:
            return (
                provisioned,
                f"holding at {provisioned} while saturated ({why}): {provisioned - ready} "
                f"replica(s) still starting",
                "hold: saturated, replicas starting",
                False,
            )
        want = provisioned + 1
        self._raised = (want, until)
        return (
            want,
            f"scale up to {want}: saturated ({why}) though the token rate asks for {recommended}",
            "scale up: saturated",
            False,
        )

    def _predicted(self) -> tuple[float, float] | None:
        latest = self.forecast.latest()
        if latest is None:
            return None
        target = self.pool.target_utilisation
        return latest[0] / target, latest[1] / target

    def _parts(self, recommended: int) -> tuple[int | None, int | None]:
        if isinstance(self.policy, policies.PredictiveWithFloor) and self.policy.last:
            predictive, reactive = self.policy.last
            return reactive, predictive
        if isinstance(self.policy, policies.Hpa):
            return recommended, None
        return None, recommended

    def _explain(
        self,
        recommended: int,
        provisioned: int,
        reactive: int | None,
        predictive: int | None,
        now_s: float,
    ) -> tuple[str, str]:
        """(the reason, the cause: the reason's direction and driver in fixed words)."""
        direction = (
            "scale up" if recommended > provisioned
            else "scale down" if recommended < provisioned else "hold"
        )  # fmt: skip
        if self.mode in ("hybrid", "advisory") and reactive is not None and predictive is not None:
            if predictive > reactive:
                short, driver = (
                    "forecast",
                    f"the forecast (predictive {predictive} > reactive {reactive})",
                )
            elif reactive > predictive:
                short = "measured load"
                driver = f"the measured load (reactive {reactive} > predictive {predictive})"
            else:
                short, driver = (
                    "forecast and load agree",
                    f"forecast and measured load agree ({reactive})",
                )
        elif self.mode == "reactive":
            short, driver = "measured load", "the measured load (HPA rules)"
        else:
            short, driver = "forecast and load", "the forecast and the measured load"
        warming = (
            ""
            if self.forecast.ready or self.mode == "reactive"
            else f"; forecast warming up ({self.forecast.num_bins} of "
            f"{MIN_FORECAST_BINS} bins), measured load only"
        )
        stale = self.forecast.stale_bins(now_s) if self.mode != "reactive" else 0
        if stale:
            reach = (
                "measured load only" if stale >= self.forecast.horizon
                else "the forecast reaches less far"
            )  # fmt: skip
            warming += (
                f"; the demand history ends {stale} bin(s) before now (late or missing "
                f"metrics): {reach}"
            )
        if recommended == self.pool.max_replicas and recommended > provisioned:
            driver += f", capped at maxReplicas {self.pool.max_replicas}"
        verb = f"{direction} at" if direction == "hold" else f"{direction} to"
        return f"{verb} {recommended}: {driver}{warming}", f"{direction}: {short}"
