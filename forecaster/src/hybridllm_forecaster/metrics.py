"""Forecast accuracy per horizon: WAPE of the median, pinball loss of both quantiles, coverage.

Pinball losses are divided by the mean actual value, so they read like WAPE (a share of
demand) and compare across traces of any scale. ``wape_moves`` is the WAPE over the
origins where demand moved by more than `MOVE` (20%) from the last observed bin by the
target bin: the ramps and jumps a scaler has to anticipate, where the last value is
wrong by construction (selected on the outcome, so read it only model against model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridllm_forecaster.forecast import Forecast


@dataclass(frozen=True)
class HorizonScore:
    model: str
    horizon: int  # bins
    wape: float
    pinball_50: float
    pinball_upper: float
    coverage_upper: float  # share of actuals at or below the upper forecast
    num_points: int
    wape_moves: float = float("nan")  # WAPE where demand moved > MOVE from the last value
    num_moves: int = 0


MOVE = 0.2


def wape(actual: np.ndarray, pred: np.ndarray) -> float:
    denom = float(np.sum(np.abs(actual)))
    return float(np.sum(np.abs(actual - pred)) / denom) if denom > 0 else float("nan")


def pinball(actual: np.ndarray, pred: np.ndarray, q: float) -> float:
    diff = actual - pred
    loss = np.maximum(q * diff, (q - 1) * diff)
    scale = float(np.mean(np.abs(actual)))
    return float(np.mean(loss) / scale) if scale > 0 else float("nan")


def score(y: np.ndarray, fc: Forecast, start: int, horizons: list[int]) -> list[HorizonScore]:
    """Scores over origins whose target bin lies in [start, len(y))."""
    n = len(y)
    out = []
    for h in horizons:
        origins = np.arange(max(0, start - h), n - h)
        if len(origins) == 0:
            continue
        actual = y[origins + h]
        p50 = fc.p50[origins, h - 1]
        up = fc.upper[origins, h - 1]
        moved = np.abs(actual - y[origins]) > MOVE * np.abs(y[origins])
        out.append(
            HorizonScore(
                model=fc.name,
                horizon=h,
                wape=wape(actual, p50),
                pinball_50=pinball(actual, p50, 0.5),
                pinball_upper=pinball(actual, up, fc.upper_q),
                coverage_upper=float(np.mean(actual <= up + 1e-12)),
                num_points=len(origins),
                wape_moves=wape(actual[moved], p50[moved]) if moved.any() else float("nan"),
                num_moves=int(moved.sum()),
            )
        )
    return out
