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

The rate files give no token lengths. ServeGen's repository keeps them beside each
``chunk-N-trace.csv`` in ``chunk-N-dataset.json``: per window start (seconds, a string
key) the client's ``input_tokens`` and ``output_tokens`` distributions, each a Python
dict literal ``{tokens: probability, ...}`` held in a JSON string (an entry holds from
its window until the next entry; an empty distribution skips the entry), as
``servegen/clientpool.py`` there reads them. `load_windows` reads them when they are
there: each window's token rates are the sum over clients of rate x that client's mean
length then. Otherwise lengths are assumed: the caller's means, else the defaults below
(roughly those of chat traffic). `Windows.lengths` says which, and every report prints
it. Sampled requests draw lengths from lognormals with each window's means.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.stream import DemandSeries, RequestStream

log = logging.getLogger(__name__)

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
    # mean request lengths per window from ``*-dataset.json`` files (None: not given)
    input_mean: np.ndarray | None = None
    output_mean: np.ndarray | None = None
    lengths: str = ""  # where the lengths come from, in words ("" : nowhere, assumed)
    input_log_sigma: float | None = None  # spread of log prompt lengths, when known


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


def load_windows(path: Path, *, files: str = "auto") -> Windows:
    """The aggregate rate windows of a ServeGen file or folder.

    Per-client files are summed window by window (clients overlap in time by nature).
    Several aggregate files (no clients) are put on one clock like request files
    (`loaders.place_files`: parts that restart at zero are joined in name order).
    """
    from hybridllm_forecaster.loaders import natural_key, place_files, placement_note

    path = Path(path)
    files_found = (
        sorted(
            (p for p in path.rglob("*") if p.is_file() and _is_servegen(p)),
            key=lambda p: natural_key(str(p)),
        )
        if path.is_dir()
        else [path]
    )
    if not files_found:
        raise TraceFormatError(path, None, "no ServeGen rate files found")
    clients = [f for f in files_found if not _is_aggregate(f)]
    use = clients or files_found  # an aggregate beside its clients would count demand twice
    parsed = [_read_file(f) for f in use]
    placed: tuple[str, ...] = ()
    if not clients and len(parsed) > 1:
        step = float(np.min(np.concatenate([np.diff(p[0]) for p in parsed if len(p[0]) > 1])))
        spans = [
            (f.name, float(p[0][0]), float(p[0][-1]) + step, 0.0)
            for f, p in zip(use, parsed, strict=True)
        ]
        offsets, how = place_files(spans, files)
        parsed = [(p[0] + off, p[1], p[2]) for p, off in zip(parsed, offsets, strict=True)]
        placed = (placement_note(how, [s[0] for s in spans], str(path)),)
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
    lengths = _dataset_lengths(use, parsed, t0, window_s, num) if clients else None
    gaps = recording_gaps(rate, present)
    notes: tuple[str, ...] = placed
    if gaps.any():
        rate, cv2 = _bridge(rate, gaps), _bridge(cv2, gaps)
        missing = int(np.sum(gaps & ~present))
        notes += (
            f"{int(gaps.sum())} recording gap window(s) bridged from their neighbours "
            f"({missing} missing, {int(gaps.sum()) - missing} with every client at zero, "
            f"each between windows of normal demand; at most {MAX_GAP_WINDOWS} in a row)",
        )
    if lengths is None:
        return Windows(window_s, rate, cv2, len(use), str(path), notes)
    tin, tout, sigma, where = lengths
    if gaps.any():
        tin, tout = _bridge(tin, gaps), _bridge(tout, gaps)
    return Windows(window_s, rate, cv2, len(use), str(path), notes, tin, tout, where, sigma)


def _dataset_lengths(
    files: list[Path],
    parsed: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    t0: float,
    window_s: float,
    num: int,
) -> tuple[np.ndarray, np.ndarray, float | None, str] | None:
    """Per-window mean input and output lengths from the ``*-dataset.json`` beside each
    client's ``*-trace.csv`` (None when no client has one): the rate-weighted mean over
    clients. Clients without one get the mean of those with one (the note counts them)."""
    dataset_of = {f: f.with_name(re.sub(r"-trace\.csv$", "-dataset.json", f.name)) for f in files}
    have = [f for f in files if f.name.endswith("-trace.csv") and dataset_of[f].is_file()]
    if not have:
        return None
    rate_in, rate_out, rate_known = np.zeros(num), np.zeros(num), np.zeros(num)
    log_m1 = log_m2 = log_w = 0.0
    for f, (start, r, _) in zip(files, parsed, strict=True):
        if f not in have:
            continue
        entries = read_dataset(dataset_of[f])
        if not entries:
            continue
        keys = np.array([e[0] for e in entries])
        pick = np.searchsorted(keys, start, side="right") - 1  # the entry in force
        ok = pick >= 0
        idx = np.rint((start[ok] - t0) / window_s).astype(np.int64)
        means_in = np.array([e[1] for e in entries])[pick[ok]]
        means_out = np.array([e[2] for e in entries])[pick[ok]]
        np.add.at(rate_in, idx, r[ok] * means_in)
        np.add.at(rate_out, idx, r[ok] * means_out)
        np.add.at(rate_known, idx, r[ok])
        weights = np.bincount(pick[ok], weights=r[ok], minlength=len(entries))
        for (_, _, _, m1, m2), w in zip(entries, weights, strict=True):
            log_m1, log_m2, log_w = log_m1 + w * m1, log_m2 + w * m2, log_w + w
    total_known = float(rate_known.sum())
    if total_known <= 0:
        return None
    pooled_in = float(rate_in.sum()) / total_known
    pooled_out = float(rate_out.sum()) / total_known
    safe = np.maximum(rate_known, 1e-12)
    tin = np.where(rate_known > 0, rate_in / safe, pooled_in)
    tout = np.where(rate_known > 0, rate_out / safe, pooled_out)
    sigma = None
    if log_w > 0:
        sigma = float(np.sqrt(max(log_m2 / log_w - (log_m1 / log_w) ** 2, 0.0)))
    where = (
        f"{len(have)} *-dataset.json file(s) beside the rate files (ServeGen's per-client "
        f"length distributions), request-weighted mean input {pooled_in:,.0f} and output "
        f"{pooled_out:,.0f} tokens"
    )
    if len(have) < len(files):
        where += (
            f"; {len(files) - len(have)} client(s) without one are given the mean of those with one"
        )
    return tin, tout, sigma, where


def read_dataset(path: Path) -> list[tuple[float, float, float, float, float]]:
    """A ServeGen ``*-dataset.json``: per entry (window start, mean input tokens, mean
    output tokens, mean and mean square of log input tokens), sorted by start.

    Each value is a distribution ``{tokens: probability}``, as ServeGen writes it (a
    Python dict literal inside a JSON string) or as a JSON object; ``{"mean": x}`` is
    read as a mean alone. Entries with an empty distribution are skipped, as ServeGen
    skips them."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFormatError(path, getattr(exc, "lineno", None), f"invalid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise TraceFormatError(path, 1, "expected an object of window start -> distributions")
    out = []
    for key, fields in raw.items():
        try:
            start = float(key)
        except ValueError:
            raise TraceFormatError(path, None, f"entry {key!r} is not a window start") from None
        if not isinstance(fields, dict):
            raise TraceFormatError(path, None, f"entry {key}: expected an object")
        moments = [
            _moments(path, key, fields.get(name)) for name in ("input_tokens", "output_tokens")
        ]
        if moments[0] is None or moments[1] is None:
            continue
        out.append((start, moments[0][0], moments[1][0], moments[0][1], moments[0][2]))
    return sorted(out)


def _moments(path: Path, key: str, value: object) -> tuple[float, float, float] | None:
    """(mean, E[log x], E[log^2 x]) of one length distribution; None when empty."""
    if value is None:
        return None
    pdf = value
    if isinstance(value, str):
        try:
            pdf = ast.literal_eval(value)
        except (ValueError, SyntaxError) as exc:
            raise TraceFormatError(path, None, f"entry {key}: not a distribution: {exc}") from exc
    if isinstance(pdf, list):
        pdf = dict(enumerate(pdf))
    if not isinstance(pdf, dict):
        raise TraceFormatError(path, None, f"entry {key}: expected a distribution")
    if not pdf:
        return None
    if set(pdf) == {"mean"}:
        mean = float(pdf["mean"])
        return mean, float(np.log(max(mean, 1.0))), float(np.log(max(mean, 1.0)) ** 2)
    try:
        x = np.array([float(k) for k in pdf], dtype=np.float64)
        p = np.array([float(v) for v in pdf.values()], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(path, None, f"entry {key}: non-numeric distribution") from exc
    if np.any(p < 0) or p.sum() <= 0:
        raise TraceFormatError(path, None, f"entry {key}: probabilities must be >= 0")
    p = p / p.sum()
    lx = np.log(np.maximum(x, 1.0))
    return float(p @ x), float(p @ lx), float(p @ (lx * lx))


MAX_GAP_WINDOWS = 2  # a longer run at zero is taken as real (a quiet night, an outage)
NORMAL_SHARE = 0.25  # a window is "normal" at >= this share of the median nonzero rate


def recording_gaps(rate: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Windows that are holes in the recording, not quiet time: missing, or at zero across
    every client, in runs of at most ``MAX_GAP_WINDOWS`` between two windows of normal
    demand. Replayed as real they look like demand dropping to nothing for a window, which
    breaks forecasts and SLO accounting alike."""
    gaps = np.zeros(len(rate), dtype=bool)
    nonzero = rate[present & (rate > 0)]
    if nonzero.size == 0:
        return gaps
    normal = present & (rate >= NORMAL_SHARE * float(np.median(nonzero)))
    for lo, hi in gap_runs(rate, present, normal, MAX_GAP_WINDOWS):
        gaps[lo:hi] = True
    return gaps


def gap_runs(
    values: np.ndarray, present: np.ndarray, normal: np.ndarray, max_run: int
) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of bins that are missing or at zero, at most ``max_run`` long,
    with a ``normal`` bin on each side."""
    hole = ~present | (values <= 0)
    runs = []
    i = 0
    while i < len(values):
        if not hole[i]:
            i += 1
            continue
        j = i
        while j < len(values) and hole[j]:
            j += 1
        if i > 0 and j < len(values) and j - i <= max_run and normal[i - 1] and normal[j]:
            runs.append((i, j))
        i = j
    return runs


def _bridge(values: np.ndarray, gaps: np.ndarray) -> np.ndarray:
    """``values`` with the gap windows interpolated linearly from their neighbours."""
    out = values.copy()
    idx = np.arange(len(values))
    out[gaps] = np.interp(idx[gaps], idx[~gaps], values[~gaps])
    return out


def lengths_used(
    w: Windows, mean_input_tokens: float | None = None, mean_output_tokens: float | None = None
) -> tuple[np.ndarray, np.ndarray, str]:
    """Per-window mean input and output lengths, and where they come from in words: the
    caller's means (``--mean-input-tokens``), else the ``*-dataset.json`` files, else the
    defaults (an assumption the report states)."""
    n = len(w.rate)
    given = mean_input_tokens is not None or mean_output_tokens is not None
    if not given and w.input_mean is not None and w.output_mean is not None:
        return w.input_mean, w.output_mean, f"request lengths: from {w.lengths}"
    tin = np.full(n, mean_input_tokens or DEFAULT_INPUT_TOKENS)
    tout = np.full(n, mean_output_tokens or DEFAULT_OUTPUT_TOKENS)
    parts = []
    for what, value, default, flag in (
        ("input", mean_input_tokens, DEFAULT_INPUT_TOKENS, "--mean-input-tokens"),
        ("output", mean_output_tokens, DEFAULT_OUTPUT_TOKENS, "--mean-output-tokens"),
    ):
        if value is not None:
            parts.append(f"{value:,.0f} {what} tokens (given, {flag})")
        else:
            parts.append(f"{default:,.0f} {what} tokens (assumed: default, {flag} to change)")
    where = "the trace has no lengths and no *-dataset.json beside it"
    if w.input_mean is not None:
        where = "given in place of the *-dataset.json lengths"
    return tin, tout, f"request lengths: {' / '.join(parts)} per request ({where})"


def to_demand(
    w: Windows,
    mean_input_tokens: float | None = None,
    mean_output_tokens: float | None = None,
) -> DemandSeries:
    tin, tout, lengths = lengths_used(w, mean_input_tokens, mean_output_tokens)
    return DemandSeries(
        bin_s=w.window_s,
        req_per_s=w.rate.copy(),
        input_tok_per_s=w.rate * tin,
        output_tok_per_s=w.rate * tout,
        arrival_cv=np.sqrt(w.cv2),
        source=w.source,
        notes=list(w.notes),
        assumptions=[lengths],
        prompt_log_sigma=w.input_log_sigma,
    )


def sample_requests(
    w: Windows,
    *,
    max_requests: int = 2_000_000,
    seed: int = 0,
    mean_input_tokens: float | None = None,
    mean_output_tokens: float | None = None,
) -> RequestStream:
    """Arrivals drawn window by window as a Gamma renewal process with the window's rate and CV.

    When the trace holds more than `max_requests` requests, every rate is scaled down by
    the same factor (recorded in `notes`), which keeps the shape of demand over time.
    Lengths are lognormal around each window's means (`lengths_used`).
    """
    rng = np.random.default_rng(seed)
    total = float(np.sum(w.rate) * w.window_s)
    scale = min(1.0, max_requests / total) if total > 0 else 1.0
    tin, tout, lengths = lengths_used(w, mean_input_tokens, mean_output_tokens)
    chunks: list[np.ndarray] = []
    window_of: list[np.ndarray] = []
    for i, (rate, cv2) in enumerate(zip(w.rate * scale, w.cv2, strict=True)):
        if rate <= 0:
            continue
        shape = 1.0 / max(cv2, 1e-3)
        mean_gap = 1.0 / rate
        n = int(rate * w.window_s * 1.3 + 10 * np.sqrt(rate * w.window_s) + 10)
        gaps = rng.gamma(shape, mean_gap / shape, size=n)
        t = np.cumsum(gaps) - gaps[0] * rng.random()
        t = t[t < w.window_s]
        chunks.append(i * w.window_s + t)
        window_of.append(np.full(len(t), i))
    arrivals = np.concatenate(chunks) if chunks else np.zeros(0)
    which = np.concatenate(window_of) if window_of else np.zeros(0, dtype=np.int64)
    order = np.argsort(arrivals, kind="stable")
    arrivals, which = arrivals[order], which[order]
    n = len(arrivals)
    notes = [f"sampled from rate windows at {scale:.4g}x the trace's rate", *w.notes, lengths]
    sigma = w.input_log_sigma if w.input_log_sigma is not None else 1.0
    return RequestStream(
        arrival_s=arrivals,
        input_tokens=_lognormal_ints(rng, tin[which], sigma, n),
        output_tokens=_lognormal_ints(rng, tout[which], 0.8, n),
        source=w.source,
        notes=notes,
    )


def _lognormal_ints(
    rng: np.random.Generator, mean: float | np.ndarray, sigma: float, n: int
) -> np.ndarray:
    mu = np.log(np.maximum(mean, 1.0)) - sigma * sigma / 2
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
