"""The operator's entry point: `plan_replicas(history, pool, now) -> Plan`.

Pure: everything it needs comes in as arguments and everything it decides goes out in
the `Plan`, including the small `PlannerState` (recent recommendations) that the next
call needs for scale-down stabilisation. The operator keeps that state in the pool's
status, so a restarted operator carries on where it left off, and tests need no clock.

Steps, each the same as the predictive policy in the simulator:
1. the pool's work series from the demand history (`PoolConfig.work_series`);
2. a forecast of the next bins up to the lead time (cold start + control interval),
   P50 and the upper quantile, from the chosen model (``auto``: gradient boosting when
   four days of history exist, Holt-Winters otherwise);
3. replicas for the larger of the largest upper forecast within the lead time and the
   work measured in the last bin (the reactive floor), at the pool's target
   utilisation, within min/max;
4. the highest recommendation of ``PoolConfig.forecast_down_window_s`` (default 0: the
   forecast already holds replicas for the whole lead time, so the pool shrinks as soon
   as the forecast says demand falls; the simulator's `policies.Predictive` does the same).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridllm_forecaster import forecast
from hybridllm_forecaster.capacity import PoolConfig
from hybridllm_forecaster.stream import DemandSeries


@dataclass(frozen=True)
class PlannerState:
    recent: tuple[tuple[float, int], ...] = ()  # (time, recommendation)


@dataclass(frozen=True)
class Plan:
    desired: int
    raw_desired: int  # before stabilisation
    upper_work_per_s: float  # largest upper forecast within the lead time
    median_work_per_s: float
    measured_work_per_s: float
    model: str
    state: PlannerState


def plan_replicas(
    history: DemandSeries,
    pool: PoolConfig,
    now_s: float,
    state: PlannerState | None = None,
    *,
    model: str = "auto",
    upper_q: float = 0.9,
) -> Plan:
    """Replicas the pool should have from now on; `history` ends with the last complete bin."""
    if history.num_bins < 4:
        raise ValueError(f"need at least 4 bins of history, got {history.num_bins}")
    y = pool.work_series(history)
    n = len(y)
    horizon = max(1, math.ceil(pool.lead_time_s / history.bin_s)) + 1
    if model == "auto":
        model = "gbm" if n * history.bin_s >= 4 * forecast.DAY_S and n >= 96 else "holt-winters"
    spec = forecast.ForecastSpec(
        bin_s=history.bin_s, horizon=horizon, upper_q=upper_q, refit_every=n,
        min_train=max(1, n - 1), start_epoch_s=history.start_epoch_s,
    )  # fmt: skip
    fc = forecast.run_model(model, y, spec)
    upper = float(np.max(fc.upper[-1]))
    median = float(np.max(fc.p50[-1]))
    measured = float(y[-1])
    raw = pool.replicas_for(max(upper, measured))
    window = pool.forecast_down_window_s
    recent = [(t, d) for t, d in (state.recent if state else ()) if t > now_s - window]
    recent.append((now_s, raw))
    desired = max(d for _, d in recent)
    return Plan(desired, raw, upper, median, measured, model, PlannerState(tuple(recent)))
