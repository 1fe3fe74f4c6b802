"""Trace loaders: detect the format from the content, read any file of it, fail with file:line.

Four formats, each accepted in the general form rather than as the shipped files:

- ``requests-csv`` (Azure LLM inference traces and alike): a header row, then one row
  per request. Columns are found by name, case-insensitively: a time column
  (``TIMESTAMP``, ``timestamp``, ``arrival_time``, ``time``: datetimes, or numbers in
  seconds, or milliseconds when the name ends in ``ms``), input tokens
  (``ContextTokens``, ``input_tokens``, ``Request tokens``, ...) and output tokens
  (``GeneratedTokens``, ``output_tokens``, ``Response tokens``, ...).
- ``mooncake`` JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length`` and
  optional ``hash_ids`` (prefix block ids).
- ``servegen`` rate windows: per-client CSV without header
  (``window_start_s, rate, iat_cv, dist, arg1, arg2``), a folder of them (clients are
  summed), or the ``t_sec, req_per_min`` aggregate. See `servegen.py`.
- ``swe-agent`` trajectories (``*.traj`` JSON), one file or a folder: session shapes,
  replayed as sessions. See `sessions.py`.

Detection reads the first bytes only, so a multi-gigabyte CSV is not read twice. Every
parse error is a `TraceFormatError` whose message starts with ``path:line:``.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from pathlib import Path

import numpy as np
import pandas as pd

from hybridllm_forecaster import servegen, sessions
from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.formats import normalise_format
from hybridllm_forecaster.stream import DemandSeries, RequestStream

log = logging.getLogger(__name__)

_TIME_COLS = (
    "timestamp", "arrival_time", "arrival_timestamp", "time", "ts", "t", "time_s", "timestamp_s",
    "timestamp_ms", "time_ms", "arrival_time_ms", "ts_ms",
)  # fmt: skip
_INPUT_COLS = (
    "contexttokens", "context_tokens", "input_tokens", "input_length", "prompt_tokens",
    "request tokens", "request_tokens", "num_prompt_tokens", "input_len",
)  # fmt: skip
_OUTPUT_COLS = (
    "generatedtokens", "generated_tokens", "output_tokens", "output_length",
    "completion_tokens", "response tokens", "response_tokens", "num_output_tokens", "output_len",
)  # fmt: skip
_SKIP_NAMES = re.compile(r"^(license|readme|notice|copying)", re.IGNORECASE)


def detect_format(path: Path) -> str:
    """The format of a file or folder, from its content (not its name)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_dir():
        found = _trace_files(path, note=True)
        kinds = set(found.values())
        if not kinds:
            raise TraceFormatError(path, None, "folder holds no trace files")
        if len(kinds) > 1:
            detail = ", ".join(f"{p.name}: {k}" for p, k in list(found.items())[:6])
            raise TraceFormatError(path, None, f"folder mixes trace formats ({detail})")
        return kinds.pop()
    head = _read_head(path)
    text = head.lstrip("\ufeff \t\r\n")
    if not text:
        raise TraceFormatError(path, 1, "file is empty")
    if text[0] in "{[":
        first = text.splitlines()[0]
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and "timestamp" in obj and "input_length" in obj:
            return "mooncake"
        if '"history"' in head or '"trajectory"' in head:
            return "swe-agent"
        raise TraceFormatError(path, 1, "JSON that is neither Mooncake JSONL nor a trajectory")
    first_line = text.splitlines()[0]
    cells = [c.strip().strip('"').lower() for c in first_line.split(",")]
    if servegen.looks_like_servegen(cells):
        return "servegen"
    if _find_col(cells, _TIME_COLS) is not None and _find_col(cells, _INPUT_COLS) is not None:
        return "requests-csv"
    raise TraceFormatError(
        path,
        1,
        "unrecognised trace: expected a CSV header with time, input and output token columns, "
        "ServeGen rate windows, Mooncake JSON lines or a SWE-agent trajectory; "
        f"first line is {first_line[:120]!r}",
    )


def load_requests(
    path: Path | str, fmt: str | None = None, *, max_requests: int = 2_000_000, seed: int = 0
) -> RequestStream:
    """One request stream from any supported trace (rate traces are sampled, scaled down)."""
    path = Path(path)
    fmt = normalise_format(fmt) or detect_format(path)
    if fmt == "requests-csv":
        return _concat([_load_requests_csv(p) for p in _files_of(path)], str(path))
    if fmt == "mooncake":
        return _concat([_load_mooncake(p) for p in _files_of(path)], str(path))
    if fmt == "servegen":
        return servegen.sample_requests(
            servegen.load_windows(path), max_requests=max_requests, seed=seed
        )
    return sessions.replay(sessions.load_sessions(path), seed=seed)


def load_demand(
    path: Path | str,
    fmt: str | None = None,
    *,
    bin_s: float | None = None,
    seed: int = 0,
    mean_input_tokens: float = servegen.DEFAULT_INPUT_TOKENS,
    mean_output_tokens: float = servegen.DEFAULT_OUTPUT_TOKENS,
) -> tuple[DemandSeries, RequestStream | None]:
    """The demand series of a trace, and its request stream when it has one.

    ServeGen rate windows give their series exactly (no sampling); every other format is
    loaded as requests and binned (`choose_bin_s` picks the bin when `bin_s` is None).
    """
    path = Path(path)
    fmt = normalise_format(fmt) or detect_format(path)
    if fmt == "servegen":
        windows = servegen.load_windows(path)
        demand = servegen.to_demand(windows, mean_input_tokens, mean_output_tokens)
        if bin_s is not None and bin_s > demand.bin_s:
            demand = demand.rebin(round(bin_s / demand.bin_s))
        return demand, None
    stream = load_requests(path, fmt, seed=seed)
    return stream.to_demand(bin_s or choose_bin_s(stream.duration_s)), stream


def choose_bin_s(duration_s: float, min_bins: int = 240) -> float:
    """The coarsest of a few round bin widths that still gives `min_bins` bins."""
    for b in (600.0, 300.0, 120.0, 60.0, 30.0, 15.0, 10.0, 5.0):
        if duration_s / b >= min_bins:
            return b
    return 5.0


def _read_head(path: Path, num_bytes: int = 65536) -> str:
    with path.open("rb") as f:
        raw = f.read(num_bytes)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start > num_bytes - 4:  # a multi-byte character cut by the read size
            return raw[: exc.start].decode("utf-8")
        line = raw[: exc.start].count(b"\n") + 1
        raise TraceFormatError(path, line, "not UTF-8 text") from exc


def _data_files(folder: Path) -> list[Path]:
    files = [
        p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and not _SKIP_NAMES.match(p.name)
    ]
    return files


def _trace_files(folder: Path, *, note: bool = False) -> dict[Path, str]:
    """Each file of a folder that is a trace, with its format. Other files are skipped
    (with a note when ``note``): upstream layouts keep metadata beside their traces, as
    ServeGen's ``*-dataset.json`` beside its ``*-trace.csv``."""
    found: dict[Path, str] = {}
    skipped: list[str] = []
    for f in _data_files(folder):
        try:
            found[f] = detect_format(f)
        except TraceFormatError as exc:
            skipped.append(f"{f.relative_to(folder)} ({exc.reason})")
    if note and skipped and found:
        log.warning(
            "%s: skipped %d file(s) that are not traces: %s%s",
            folder,
            len(skipped),
            "; ".join(skipped[:3]),
            f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "",
        )
    return found


def _files_of(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    found = _trace_files(path)
    return [f for f, kind in found.items() if kind == detect_format(path)]


def _find_col(names: list[str], candidates: tuple[str, ...]) -> int | None:
    for cand in candidates:
        if cand in names:
            return names.index(cand)
    return None


def _load_requests_csv(path: Path) -> RequestStream:
    try:
        df = pd.read_csv(path, skipinitialspace=True, on_bad_lines="error", low_memory=False)
    except pd.errors.ParserError as exc:
        match = re.search(r"line (\d+)", str(exc))
        raise TraceFormatError(path, int(match.group(1)) if match else None, str(exc)) from exc
    except pd.errors.EmptyDataError as exc:
        raise TraceFormatError(path, 1, "file is empty") from exc
    names = [c.strip().lower() for c in df.columns]
    i_time, i_in = _find_col(names, _TIME_COLS), _find_col(names, _INPUT_COLS)
    i_out = _find_col(names, _OUTPUT_COLS)
    if i_time is None or i_in is None or i_out is None:
        raise TraceFormatError(
            path, 1, f"header {list(df.columns)} lacks a time, input or output token column"
        )
    if df.empty:
        raise TraceFormatError(path, 2, "no request rows after the header")
    col_time = df.columns[i_time]
    raw_time = df[col_time]
    numeric_time = pd.to_numeric(raw_time, errors="coerce")
    epoch: float | None = None
    if numeric_time.notna().all():
        t = numeric_time.to_numpy(np.float64)
        if names[i_time].endswith("ms"):
            t = t / 1000.0
    else:
        stamps = pd.to_datetime(raw_time, errors="coerce", format="ISO8601")
        _check_column(path, raw_time, stamps.isna(), col_time, "a date-time or a number")
        if stamps.dt.tz is not None:
            stamps = stamps.dt.tz_convert(None)
        t = (stamps - pd.Timestamp(0)).dt.total_seconds().to_numpy(np.float64)
        epoch = float(t.min())
    tokens = []
    for i in (i_in, i_out):
        raw = df[df.columns[i]]
        num = pd.to_numeric(raw, errors="coerce")
        _check_column(path, raw, num.isna() | (num < 0), df.columns[i], "a token count >= 0")
        tokens.append(num.to_numpy(np.float64).round().astype(np.int64))
    order = np.argsort(t, kind="stable")
    t0 = float(t[order[0]])
    return RequestStream(
        arrival_s=t[order] - t0,
        input_tokens=tokens[0][order],
        output_tokens=tokens[1][order],
        source=str(path),
        start_epoch_s=epoch,
        origin_s=t0,
    )


def _check_column(path: Path, raw: pd.Series, bad: pd.Series, name: str, want: str) -> None:
    if bad.any():
        row = int(np.argmax(bad.to_numpy()))
        raise TraceFormatError(
            path, row + 2, f"column {name!r} is {raw.iloc[row]!r}, expected {want}"
        )


def _load_mooncake(path: Path) -> RequestStream:
    times: list[float] = []
    tin: list[int] = []
    tout: list[int] = []
    prefixes: list[list[int]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, lineno, f"invalid JSON: {exc.msg}") from exc
            if not isinstance(rec, dict):
                raise TraceFormatError(path, lineno, "expected a JSON object per line")
            try:
                t, i, o = (
                    float(rec["timestamp"]),
                    int(rec["input_length"]),
                    int(rec["output_length"]),
                )
            except KeyError as exc:
                raise TraceFormatError(path, lineno, f"missing field {exc.args[0]!r}") from exc
            except (TypeError, ValueError) as exc:
                raise TraceFormatError(path, lineno, f"non-numeric field: {exc}") from exc
            if i < 0 or o < 0 or not np.isfinite(t):
                raise TraceFormatError(path, lineno, "negative token count or bad timestamp")
            hashes = rec.get("hash_ids") or []
            if not isinstance(hashes, list):
                raise TraceFormatError(path, lineno, "hash_ids must be a list")
            times.append(t / 1000.0)
            tin.append(i)
            tout.append(o)
            prefixes.append([int(h) for h in hashes])
    if not times:
        raise TraceFormatError(path, 1, "no requests in file")
    t_arr = np.asarray(times)
    order = np.argsort(t_arr, kind="stable")
    return RequestStream(
        arrival_s=t_arr[order] - t_arr[order[0]],
        input_tokens=np.asarray(tin, dtype=np.int64)[order],
        output_tokens=np.asarray(tout, dtype=np.int64)[order],
        prefix_ids=[prefixes[k] for k in order],
        source=str(path),
        origin_s=float(t_arr[order[0]]),
    )


JOIN_TOLERANCE_S = 1.0  # consecutive parts may share their boundary second


def _concat(streams: list[RequestStream], source: str) -> RequestStream:
    """Several files of one format on one clock: each file's timestamps as written (epochs
    for date-time columns). Parts of a trace split by time follow one another and are
    joined; files that overlap in time (one per server) are merged; either way the
    report's header says which. Files that all start at the same time are merged as
    simultaneous (parts whose clocks each restart at zero cannot be told from servers),
    and the note says so."""
    if len(streams) == 1:
        return streams[0]
    epochs = [s.start_epoch_s for s in streams]
    origins = [e if e is not None else s.origin_s for s, e in zip(streams, epochs, strict=True)]
    if any(e is not None for e in epochs) and not all(e is not None for e in epochs):
        origins = [s.origin_s for s in streams]  # mixed clocks: each file's own numbers
    first = min(origins)
    starts = [o - first for o in origins]
    spans = sorted(
        (start, start + s.duration_s, s.source) for start, s in zip(starts, streams, strict=True)
    )
    consecutive = all(nxt[0] >= cur[1] - JOIN_TOLERANCE_S for cur, nxt in itertools.pairwise(spans))
    if consecutive:
        note = f"{len(streams)} files of {source} joined by time (consecutive parts, one clock)"
    elif max(origins) - first <= JOIN_TOLERANCE_S:
        note = (
            f"{len(streams)} files of {source} all start at the same time: merged as "
            "simultaneous (if they are consecutive parts of one trace whose clocks each "
            "restart at zero, give them one clock)"
        )
    else:
        note = f"{len(streams)} files of {source} overlap in time: merged by arrival time"
    log.info(note)
    t = np.concatenate([s.arrival_s + start for s, start in zip(streams, starts, strict=True)])
    order = np.argsort(t, kind="stable")
    prefix: list[list[int]] | None = None
    if all(s.prefix_ids is not None for s in streams):
        flat = [p for s in streams for p in (s.prefix_ids or [])]
        prefix = [flat[k] for k in order]
    known = [e for e in epochs if e is not None]
    return RequestStream(
        arrival_s=t[order] - t[order[0]],
        input_tokens=np.concatenate([s.input_tokens for s in streams])[order],
        output_tokens=np.concatenate([s.output_tokens for s in streams])[order],
        prefix_ids=prefix,
        source=source,
        start_epoch_s=min(known) if len(known) == len(streams) else None,
        notes=[note],
        origin_s=first,
    )
