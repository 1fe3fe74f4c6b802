"""ServeGen rate traces: per-client windows summed into one aggregate demand.

A per-client file has one row per window and no header:
``window_start_s, rate_req_per_s, iat_cv, iat_dist (Gamma/Weibull/blank), arg1, arg2``.
Clients are independent renewal processes, so their sum has rate ``sum(rate_i)``. The
squared coefficient of variation of the superposed arrivals, which the queueing
approximation needs, follows Whitt's QNA: a blend of the asymptotic value
``sum(rate_i * cv_i^2) / sum(rate_i)`` and 1 (Poisson), weighted by
``w = 1 / (1 + 4 (1 - rho)^2 (nu - 1))`` where ``nu = 1 / sum((rate_i / rate)^2)`` is the
effective number of clients and rho = 0.7 a typical utilisation: many small clients
superpose to nearly Poisson, one dominant client keeps its burstiness. The aggregate
file (``t_sec, req_per_min``) carries no variability, so its windows get cv = 1.

The traces give no token lengths. `to_demand` multiplies rates by mean input and output
lengths given by the caller (defaults below, roughly those of chat traffic); sampled
requests draw lengths from lognormals with those means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.stream import DemandSeries, RequestStream

DEFAULT_INPUT_TOKENS = 1500.0
DEFAULT_OUTPUT_TOKENS = 300.0
QNA_RHO = 0.7
_DISTS = {"gamma", "weibull", "", "exponential", "nan"}


@dataclass(frozen=True)
class Windows:
    window_s: float
    rate: np.ndarray  # [num_windows] aggregate requests/s
    cv2: np.ndarray  # [num_windows] squared inter-arrival CV of the aggregate
    num_clients: int
    source: str
    notes: tuple[str, ...] = ()  # repairs made while loading (recording gaps bridged)


def looks_like_servegen(cells: list[str]) -> bool:
    if len(cells) == 2 and cells[0].startswith("t") and "req" in cells[1]:
        return True
    if len(cells) != 6 or cells[3] not in _DISTS:
        return False
    try:
        float(cells[0]), float(cells[1])
    except ValueError:
        return False
    return True


def load_windows(path: Path) -> Windows:
    path = Path(path)
    files = (
        [p for p in sorted(path.rglob("*")) if p.is_file() and _is_servegen(p)]
        if path.is_dir()
        else [path]
    )
    if not files:
        raise TraceFormatError(path, None, "no ServeGen rate files found")
    clients = [f for f in files if not _is_aggregate(f)]
    use = clients or files  # an aggregate beside its clients would count demand twice
    parsed = [_read_file(f) for f in use]
    starts = np.unique(np.concatenate([p[0] for p in parsed]))
    window_s = float(np.min(np.diff(starts))) if len(starts) > 1 else 600.0
    t0 = float(starts[0])
    num = round((starts[-1] - t0) / window_s) + 1
    rate = np.zeros(num)
    rate_cv2 = np.zeros(num)
    rate_sq = np.zeros(num)
    present = np.zeros(num, dtype=bool)
    for start, r, cv in parsed:
        idx = np.rint((start - t0) / window_s).astype(np.int64)
        present[idx] = True
        np.add.at(rate, idx, r)
        np.add.at(rate_cv2, idx, r * cv * cv)
        np.add.at(rate_sq, idx, r * r)
    safe = np.maximum(rate, 1e-12)
    asymptotic = np.where(rate > 0, rate_cv2 / safe, 1.0)
    nu = np.where(rate_sq > 0, safe * safe / np.maximum(rate_sq, 1e-24), 1.0)
    weight = 1.0 / (1.0 + 4.0 * (1.0 - QNA_RHO) ** 2 * (nu - 1.0))
    cv2 = weight * asymptotic + (1.0 - weight)
    gaps = recording_gaps(rate, present)
    notes: tuple[str, ...] = ()
    if gaps.any():
        rate, cv2 = _bridge(rate, gaps), _bridge(cv2, gaps)
        missing = int(np.sum(gaps & ~present))
        notes = (
            f"{int(gaps.sum())} recording gap window(s) bridged from their neighbours "
            f"({missing} missing, {int(gaps.sum()) - missing} with every client at zero, "
            f"each between windows of normal demand; at most {MAX_GAP_WINDOWS} in a row)",
        )
    return Windows(window_s, rate, cv2, len(use), str(path), notes)


MAX_GAP_WINDOWS = 2  # a longer run at zero is taken as real (a quiet night, an outage)
NORMAL_SHARE = 0.25  # a window is "normal" at >= this share of the median nonzero rate


def recording_gaps(rate: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Windows that are holes in the recording, not quiet time: missing, or at zero across
    every client, in runs of at most ``MAX_GAP_WINDOWS`` between two windows of normal
    demand. Replayed as real they look like demand dropping to nothing for a window, which
    breaks forecasts and SLO accounting alike."""
    nonzero = rate[present & (rate > 0)]
    if nonzero.size == 0:
        return np.zeros(len(rate), dtype=bool)
    normal = present & (rate >= NORMAL_SHARE * float(np.median(nonzero)))
    hole = ~present | (rate <= 0)
    gaps = np.zeros(len(rate), dtype=bool)
    i = 0
    while i < len(rate):
        if not hole[i]:
            i += 1
            continue
        j = i
        while j < len(rate) and hole[j]:
            j += 1
        if i > 0 and j < len(rate) and j - i <= MAX_GAP_WINDOWS and normal[i - 1] and normal[j]:
            gaps[i:j] = True
        i = j
    return gaps


def _bridge(values: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """``values`` with the gap windows interpolated linearly from their neighbours."""
    out = values.copy()
    idx = np.arange(len(values))
    out[gaps] = np.interp(idx[gaps], idx[~gaps], values[~gaps])
    return out


def to_demand(
    w: Windows,
    mean_input_tokens: float = DEFAULT_INPUT_TOKENS,
    mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
) -> DemandSeries:
    return DemandSeries(
        bin_s=w.window_s,
        req_per_s=w.rate.copy(),
        input_tok_per_s=w.rate * mean_input_tokens,
        output_tok_per_s=w.rate * mean_output_tokens,
        arrival_cv=np.sqrt(w.cv2),
        source=w.source,
        notes=list(w.notes),
    )


def sample_requests(
    w: Windows,
    *,
    max_requests: int = 2_000_000,
    seed: int = 0,
    mean_input_tokens: float = DEFAULT_INPUT_TOKENS,
    mean_output_tokens: float = DEFAULT_OUTPUT_TOKENS,
) -> RequestStream:
    """Arrivals drawn window by window as a Gamma renewal process with the window's rate and CV.

    When the trace holds more than `max_requests` requests, every rate is scaled down by
    the same factor (recorded in `notes`), which keeps the shape of demand over time.
    """
    rng = np.random.default_rng(seed)
    total = float(np.sum(w.rate) * w.window_s)
    scale = min(1.0, max_requests / total) if total > 0 else 1.0
    chunks: list[np.ndarray] = []
    for i, (rate, cv2) in enumerate(zip(w.rate * scale, w.cv2, strict=True)):
        if rate <= 0:
            continue
        shape = 1.0 / max(cv2, 1e-3)
        mean_gap = 1.0 / rate
        n = int(rate * w.window_s * 1.3 + 10 * np.sqrt(rate * w.window_s) + 10)
        gaps = rng.gamma(shape, mean_gap / shape, size=n)
        t = np.cumsum(gaps) - gaps[0] * rng.random()
        chunks.append(i * w.window_s + t[t < w.window_s])
    arrivals = np.sort(np.concatenate(chunks)) if chunks else np.zeros(0)
    n = len(arrivals)
    notes = [f"sampled from rate windows at {scale:.4g}x the trace's rate", *w.notes]
    return RequestStream(
        arrival_s=arrivals,
        input_tokens=_lognormal_ints(rng, mean_input_tokens, 1.0, n),
        output_tokens=_lognormal_ints(rng, mean_output_tokens, 0.8, n),
        source=w.source,
        notes=notes,
    )


def _lognormal_ints(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    mu = np.log(mean) - sigma * sigma / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def _first_line(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        return f.readline().lstrip("\ufeff")


def _is_servegen(path: Path) -> bool:
    cells = [c.strip().strip('"').lower() for c in _first_line(path).split(",")]
    return looks_like_servegen(cells)


def _is_aggregate(path: Path) -> bool:
    return len(_first_line(path).split(",")) == 2


def _read_file(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window starts, rate req/s, inter-arrival CV) of one file; errors name the line."""
    aggregate = _is_aggregate(path)
    try:
        df = pd.read_csv(path, header=0 if aggregate else None, dtype=str, keep_default_na=False)
    except pd.errors.ParserError as exc:
        raise TraceFormatError(path, None, str(exc)) from exc
    except pd.errors.EmptyDataError as exc:
        raise TraceFormatError(path, 1, "file is empty") from exc
    first_row_line = 2 if aggregate else 1
    want_cols = 2 if aggregate else 6
    if df.shape[1] != want_cols:
        raise TraceFormatError(path, first_row_line, f"expected {want_cols} columns")
    cols = [0, 1] if aggregate else [0, 1, 2]
    values = []
    for c in cols:
        raw = df.iloc[:, c]
        num = pd.to_numeric(raw, errors="coerce")
        if c == 2:  # the CV is blank where the rate is zero
            num = num.where(raw.str.strip() != "", 1.0)
        bad = num.isna() | (num < 0)
        if bad.any():
            row = int(np.argmax(bad.to_numpy()))
            raise TraceFormatError(
                path,
                row + first_row_line,
                f"column {c + 1} is {raw.iloc[row]!r}, expected a number >= 0",
            )
        values.append(num.to_numpy(np.float64))
    if aggregate:
        return values[0], values[1] / 60.0, np.ones(len(values[0]))
    return values[0], values[1], values[2]
