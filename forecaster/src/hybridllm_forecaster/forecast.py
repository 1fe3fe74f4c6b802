"""Forecasting models, run as rolling-origin forecasts over a whole series.

Every model answers the same question for every bin ``i``: knowing ``y[: i + 1]``, what
will ``y[i + 1 : i + 1 + H]`` be? The answer is two arrays ``p50[i, h - 1]`` and
``upper[i, h - 1]`` (the `upper_q` quantile). Computing them for all origins at once is
what makes evaluating and simulating 14 days cheap; the online behaviour is preserved
because nothing at origin ``i`` looks past ``y[i]``, and models that learn are refit
every ``refit_every`` bins on the data seen so far (`online_refits`).

Models:
- ``last``: the last value (the baseline to beat).
- ``seasonal``: the value one day earlier (only when the series spans two days).
- ``holt-winters``: additive Holt-Winters on log demand with a daily season when two
  days are known, otherwise damped Holt (EWMA with trend); smoothing constants chosen
  by one-step error on the training part.
- ``gbm``: scikit-learn `HistGradientBoostingRegressor` with quantile loss, one model
  per quantile with the horizon as a feature. Features and target are log ratios to
  the recent level, so a model fitted at one traffic scale applies at another, and
  trees, which cannot extrapolate, never need to.

The baselines get their upper quantile from their own past errors (the empirical
quantile of log(actual / forecast) per horizon, recomputed at each refit), so every
model is compared on the same two numbers.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

log = logging.getLogger(__name__)

DAY_S = 86_400.0
MODELS = ("last", "seasonal", "holt-winters", "gbm")
# smallest leaf of the gbm's trees. A ramp that comes at the same time every day is 2-3
# bins a day, 10-15 examples in a week, and leaves of 40 average part of it away: on a
# synthetic daily ramp the WAPE on the bins that moved is 27% (last value 43%), 4% with
# leaves of 10. Chosen among 5/10/20/40 on the training halves of the development
# traces only (bench/forecaster/choose_min_leaf.py, bench/results/forecaster/min-leaf.md):
# 10 has the lowest P90 pinball over the last value's (geometric mean over traces), and
# beats 40 on both ServeGen cases, by 1-2%.
GBM_MIN_LEAF = 10


@dataclass(frozen=True)
class ForecastSpec:
    bin_s: float
    horizon: int  # bins ahead, >= 1
    upper_q: float = 0.9
    train_until: int | None = None  # bins [0, train_until) tune smoothing constants
    refit_every: int | None = None  # bins between refits (default: about 12 refits)
    min_train: int = 48  # bins needed before a learned model is first fitted
    start_epoch_s: float | None = None
    season_s: float = DAY_S  # the demand's repeating period (a day; shorter in a replay)

    @property
    def period(self) -> int:
        return max(1, round(self.season_s / self.bin_s))


@dataclass(frozen=True)
class Forecast:
    name: str
    p50: np.ndarray  # [num_bins, horizon]
    upper: np.ndarray  # [num_bins, horizon]
    upper_q: float


def run_model(name: str, y: np.ndarray, spec: ForecastSpec) -> Forecast:
    fn: dict[str, Callable[[np.ndarray, ForecastSpec], Forecast]] = {
        "last": _last,
        "seasonal": _seasonal,
        "holt-winters": _holt_winters,
        "gbm": _gbm,
    }
    if name not in fn:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return fn[name](np.asarray(y, dtype=float), spec)


def has_season(num_bins: int, spec: ForecastSpec) -> bool:
    return num_bins >= 2 * spec.period and spec.period > 1


def refit_points(num_bins: int, spec: ForecastSpec) -> list[int]:
    """Origins at which learned models refit (each sees only bins before the point)."""
    start = spec.min_train
    every = spec.refit_every or max(1, (num_bins - start) // 16)
    return list(range(start, num_bins, every))


def _eps(y: np.ndarray, spec: ForecastSpec) -> float:
    """A floor for logs, from the first bins only (so later data changes no earlier forecast)."""
    return 1e-3 * float(np.mean(np.abs(y[: max(1, spec.min_train)]))) + 1e-9


def _shifted(y: np.ndarray, k: int) -> np.ndarray:
    """y shifted so that out[i] = y[i - k] (NaN where i - k is outside)."""
    out = np.full(len(y), np.nan)
    if k >= 0:
        if k < len(y):
            out[k:] = y[: len(y) - k]
    elif -k < len(y):
        out[:k] = y[-k:]
    return out


def _with_empirical_upper(
    name: str, y: np.ndarray, p50: np.ndarray, spec: ForecastSpec
) -> Forecast:
    """Upper quantile from the model's own past errors, per horizon, refreshed at each refit."""
    n, horizon = p50.shape
    eps = _eps(y, spec)
    log_err = np.full((n, horizon), np.nan)
    for h in range(1, horizon + 1):
        actual = _shifted(y, -h)
        log_err[:, h - 1] = np.log((actual + eps) / (np.maximum(p50[:, h - 1], 0) + eps))
    mult = np.full((n, horizon), 1.25)
    points = [*refit_points(n, spec), n]
    for a, b in itertools.pairwise(points):
        for h in range(1, horizon + 1):
            seen = log_err[: max(0, a - h), h - 1]
            seen = seen[np.isfinite(seen)]
            if len(seen) >= 20:
                mult[a:b, h - 1] = np.exp(max(0.0, float(np.quantile(seen, spec.upper_q))))
    return Forecast(name, p50, np.maximum(p50, 0) * mult, spec.upper_q)


def _last(y: np.ndarray, spec: ForecastSpec) -> Forecast:
    p50 = np.repeat(y[:, None], spec.horizon, axis=1)
    return _with_empirical_upper("last", y, p50, spec)


def _seasonal(y: np.ndarray, spec: ForecastSpec) -> Forecast:
    p = spec.period
    n = len(y)
    p50 = np.empty((n, spec.horizon))
    for h in range(1, spec.horizon + 1):
        lag = _shifted(y, p - h) if p >= h else _shifted(y, 0)
        p50[:, h - 1] = np.where(np.isnan(lag), y, lag)
    return _with_empirical_upper("seasonal", y, p50, spec)


def _hw_pass(
    z: np.ndarray, alpha: float, beta: float, gamma: float, phi: float, period: int, horizon: int
) -> tuple[np.ndarray, float]:
    """One additive Holt-Winters pass; returns [n, horizon] forecasts and the 1-step SSE."""
    n = len(z)
    seasonal = period > 1 and n >= 2 * period
    season = np.zeros(period if seasonal else 1)
    if seasonal:
        first = z[:period]
        season = first - first.mean()
    level, trend = float(z[0]), 0.0
    out = np.empty((n, horizon))
    damp = np.cumsum(phi ** np.arange(1, horizon + 1))
    sse = 0.0
    for i in range(n):
        s_i = season[i % period] if seasonal else 0.0
        pred = level + phi * trend + s_i
        if i > 0:
            sse += (z[i] - pred) ** 2
        new_level = alpha * (z[i] - s_i) + (1 - alpha) * (level + phi * trend)
        trend = beta * (new_level - level) + (1 - beta) * phi * trend
        level = new_level
        if seasonal:
            season[i % period] = gamma * (z[i] - level) + (1 - gamma) * s_i
        idx = (i + 1 + np.arange(horizon)) % period if seasonal else None
        out[i] = level + damp * trend + (season[idx] if seasonal else 0.0)
    return out, sse


def _holt_winters(y: np.ndarray, spec: ForecastSpec) -> Forecast:
    eps = _eps(y, spec)
    z = np.log(y + eps)
    period = spec.period if has_season(len(y), spec) else 1
    tune_end = spec.train_until or len(y)
    best: tuple[float, tuple[float, float, float]] | None = None
    for alpha in (0.1, 0.3, 0.6, 0.9):
        for beta in (0.0, 0.05):
            for gamma in (0.05, 0.2) if period > 1 else (0.0,):
                _, sse = _hw_pass(z[:tune_end], alpha, beta, gamma, 0.9, period, 1)
                if best is None or sse < best[0]:
                    best = (sse, (alpha, beta, gamma))
    assert best is not None
    alpha, beta, gamma = best[1]
    log.debug("holt-winters: alpha=%s beta=%s gamma=%s period=%s", alpha, beta, gamma, period)
    out, _ = _hw_pass(z, alpha, beta, gamma, 0.9, period, spec.horizon)
    return _with_empirical_upper("holt-winters", y, np.maximum(np.exp(out) - eps, 0.0), spec)


def gbm_features(y: np.ndarray, spec: ForecastSpec, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Features for every origin at horizon `h`, and the log level (last value) they refer to.

    Demand at the bin level is close to a random walk, so the target is the log change
    from the last value; lags, rolling means and volatility tell the model when a jump
    tends to revert, and the daily lags and time of day when a ramp is due.
    """
    n = len(y)
    eps = _eps(y, spec)
    ly = np.log(y + eps)
    csum = np.concatenate([[0.0], np.cumsum(ly)])

    def roll(k: int) -> np.ndarray:
        i = np.arange(n)
        lo = np.maximum(0, i - k + 1)
        return (csum[i + 1] - csum[lo]) / (i + 1 - lo)

    level = ly
    cols = [_shifted(ly, k) - level for k in range(1, 12)]
    cols += [roll(k) - level for k in (3, 6, 12, 36, 144)]
    diff = np.diff(ly, prepend=ly[0])
    cols += [np.sqrt(roll_sq(diff, k)) for k in (6, 36)]
    p = spec.period
    if has_season(n, spec) and p >= h:  # (an all-NaN column would break the binning)
        cols.append(_shifted(ly, p - h) - level)  # same time yesterday
        cols.append(_shifted(ly, p - h) - _shifted(ly, p))  # and its ramp from there
    t = (np.arange(n) + h + 0.5) * spec.bin_s + (spec.start_epoch_s or 0.0)
    tod = 2 * np.pi * (t % spec.season_s) / spec.season_s
    cols += [np.sin(tod), np.cos(tod), np.full(n, float(h))]
    return np.column_stack(cols), level


def roll_sq(x: np.ndarray, k: int) -> np.ndarray:
    c = np.concatenate([[0.0], np.cumsum(x * x)])
    i = np.arange(len(x))
    lo = np.maximum(0, i - k + 1)
    return (c[i + 1] - c[lo]) / (i + 1 - lo)


def _gbm(y: np.ndarray, spec: ForecastSpec) -> Forecast:
    # imported here: the operator's autoscaler imports this module, and most of its
    # models (and every command that loads it) need no scikit-learn
    from sklearn.ensemble import HistGradientBoostingRegressor

    n, horizon = len(y), spec.horizon
    eps = _eps(y, spec)
    ly = np.log(y + eps)
    feats, targets, levels = [], [], []
    for h in range(1, horizon + 1):
        x, level = gbm_features(y, spec, h)
        feats.append(x)
        levels.append(level)
        targets.append(_shifted(ly, -h) - level)
    fallback = _holt_winters(y, spec)
    p50, upper = fallback.p50.copy(), fallback.upper.copy()
    points = refit_points(n, spec)
    rng = np.random.default_rng(0)
    first = 12  # origins before this have too few lags
    # Small data: threads cost more than they give. One limit around every fit and
    # predict (each `threadpool_limits` scans the process's libraries: 3 ms a call, which
    # was 40% of an evaluation's time when taken per call).
    with threadpool_limits(1):
        for a, b in zip(points, [*points[1:], n], strict=True):
            rows_x, rows_y = [], []
            for h in range(1, horizon + 1):
                last_origin = a - h  # target y[origin + h] must be < a
                if last_origin <= first:
                    continue
                rows_x.append(feats[h - 1][first:last_origin])
                rows_y.append(targets[h - 1][first:last_origin])
            if not rows_x:
                continue
            x_train, y_train = np.concatenate(rows_x), np.concatenate(rows_y)
            if len(x_train) > 60_000:
                keep = rng.choice(len(x_train), 60_000, replace=False)
                x_train, y_train = x_train[keep], y_train[keep]
            if len(x_train) < spec.min_train:
                continue
            use = ~np.all(np.isnan(x_train), axis=0)  # e.g. yesterday's lag not yet known
            x_train = x_train[:, use]
            for q, dest in ((0.5, p50), (spec.upper_q, upper)):
                model = HistGradientBoostingRegressor(
                    loss="quantile", quantile=q, max_iter=100, learning_rate=0.05,
                    max_leaf_nodes=7, min_samples_leaf=GBM_MIN_LEAF, random_state=0,
                )  # fmt: skip
                model.fit(x_train, y_train)
                for h in range(1, horizon + 1):
                    pred = model.predict(feats[h - 1][a:b][:, use])
                    dest[a:b, h - 1] = np.maximum(np.exp(levels[h - 1][a:b] + pred) - eps, 0.0)
    if points:
        p50 = _shrink_to_last(y, p50, points)
    upper = np.maximum(upper, p50)
    return Forecast("gbm", p50, upper, spec.upper_q)


def _shrink_to_last(y: np.ndarray, p50: np.ndarray, points: list[int]) -> np.ndarray:
    """Blend the model's median with the last value where that has done better so far.

    Bin-level demand is close to a random walk, and a tree model fitted on a few days is
    noisy; a geometric blend ``model^(1-w) * last^w`` with ``w`` chosen per horizon on
    the model's own out-of-sample forecasts before each refit (a forecast combination)
    keeps what the model knows (seasonal ramps: w = 0) and drops what it does not.
    """
    n, horizon = p50.shape
    eps = 1e-9 + 1e-6 * float(np.mean(y[: points[0]]))
    out = p50.copy()
    bounds = [*points, n]
    for a, b in itertools.pairwise(bounds):
        for h in range(1, horizon + 1):
            origins = np.arange(points[0], max(points[0], a - h))
            if len(origins) < 20:
                continue
            actual = y[origins + h]
            best_w, best_err = 0.0, np.inf
            for w in (0.0, 0.25, 0.5, 0.75):
                blend = np.exp(
                    (1 - w) * np.log(p50[origins, h - 1] + eps) + w * np.log(y[origins] + eps)
                )
                err = float(np.sum(np.abs(actual - blend)))
                if err < best_err - 1e-12:
                    best_w, best_err = w, err
            if best_w > 0:
                out[a:b, h - 1] = np.exp(
                    (1 - best_w) * np.log(p50[a:b, h - 1] + eps) + best_w * np.log(y[a:b] + eps)
                )
    return out
