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
from dataclasses import replace
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
    path: Path | str,
    fmt: str | None = None,
    *,
    max_requests: int = 2_000_000,
    seed: int = 0,
    files: str = "auto",
) -> RequestStream:
    """One request stream from any supported trace (rate traces are sampled, scaled down).

    Several files of a folder are put on one clock by `place_files` (``files``: "auto",
    "join" or "merge"); recording gaps of request traces are closed
    (`close_recording_gaps`), those of rate traces bridged (`servegen.load_windows`).
    """
    path = Path(path)
    fmt = normalise_format(fmt) or detect_format(path)
    if fmt == "requests-csv":
        stream = _concat([_load_requests_csv(p) for p in _files_of(path)], str(path), files)
        return close_recording_gaps(stream)
    if fmt == "mooncake":
        stream = _concat([_load_mooncake(p) for p in _files_of(path)], str(path), files)
        return close_recording_gaps(stream)
    if fmt == "servegen":
        return servegen.sample_requests(
            servegen.load_windows(path, files=files), max_requests=max_requests, seed=seed
        )
    return sessions.replay(sessions.load_sessions(path), seed=seed)


def load_demand(
    path: Path | str,
    fmt: str | None = None,
    *,
    bin_s: float | None = None,
    seed: int = 0,
    mean_input_tokens: float | None = None,
    mean_output_tokens: float | None = None,
    files: str = "auto",
) -> tuple[DemandSeries, RequestStream | None]:
    """The demand series of a trace, and its request stream when it has one.

    ServeGen rate windows give their series exactly (no sampling); every other format is
    loaded as requests and binned (`choose_bin_s` picks the bin when `bin_s` is None).
    The series' ``assumptions`` say where request lengths came from: the requests
    themselves, a ServeGen ``*-dataset.json`` beside the rate files, the given means, or
    (a rate trace with none of these) `servegen.DEFAULT_INPUT_TOKENS` and
    `servegen.DEFAULT_OUTPUT_TOKENS`.
    """
    path = Path(path)
    fmt = normalise_format(fmt) or detect_format(path)
    if fmt == "servegen":
        windows = servegen.load_windows(path, files=files)
        demand = servegen.to_demand(windows, mean_input_tokens, mean_output_tokens)
        if bin_s is not None and bin_s > demand.bin_s:
            demand = demand.rebin(round(bin_s / demand.bin_s))
        return demand, None
    stream = load_requests(path, fmt, seed=seed, files=files)
    demand = stream.to_demand(bin_s or choose_bin_s(stream.duration_s))
    how = "replayed from trajectory shapes" if fmt == "swe-agent" else "the trace's own"
    lengths = (
        f"request lengths: {how}, per request (mean input "
        f"{stream.input_tokens.mean():,.0f}, output {stream.output_tokens.mean():,.0f} tokens)"
    )
    return replace(demand, assumptions=[lengths]), stream


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
RESTART_TOLERANCE_S = 60.0  # a file whose clock starts this close to zero "restarts" it
FILE_MODES = ("auto", "join", "merge")  # `--files`: how several files of one trace combine


def natural_key(name: str) -> list[int | str]:
    """Sort key that puts ``part-2`` before ``part-10``."""
    return [int(tok) if tok.isdigit() else tok.lower() for tok in re.split(r"(\d+)", name)]


def place_files(
    spans: list[tuple[str, float, float, float]], mode: str = "auto"
) -> tuple[list[float], str]:
    """Where the files of one trace go on one clock: an offset (seconds) to add to each
    file's own timestamps, and how they were combined.

    ``spans`` holds per file ``(name, start, end, step)`` on the file's own clock, where
    ``step`` is the spacing to leave after it when the next file is placed behind it (a
    mean inter-arrival time, or one rate window). With ``mode`` "auto" the timestamps
    decide: files whose ranges follow one another are "consecutive" (kept as written);
    files whose clocks restart (in name order, a file starts near zero before the one
    before it ends, as public traces split by time ship them) are "restart" (each placed
    after the one before, in name order); files that overlap otherwise are "overlap"
    (merged as written: one per server or client). "join" forces the name-order chain,
    "merge" forces merging as written.
    """
    if mode not in FILE_MODES:
        raise ValueError(f"--files {mode!r}: expected one of {', '.join(FILE_MODES)}")
    zero = [0.0] * len(spans)
    if len(spans) < 2:
        return zero, "single"
    if mode == "merge":
        return zero, "merge"
    by_start = sorted(spans, key=lambda s: s[1])
    consecutive = all(
        nxt[1] >= cur[2] - JOIN_TOLERANCE_S for cur, nxt in itertools.pairwise(by_start)
    )
    if consecutive and mode == "auto":
        return zero, "consecutive"
    order = sorted(range(len(spans)), key=lambda k: natural_key(spans[k][0]))
    offsets = list(zero)
    offset, restarts = 0.0, 0
    _, _, prev_end, prev_step = spans[order[0]]
    for k in order[1:]:
        _, start, end, step = spans[k]
        if start + offset < prev_end - JOIN_TOLERANCE_S:
            restarts_here = start <= max(RESTART_TOLERANCE_S, 0.01 * (end - start))
            if mode == "auto" and not restarts_here:
                return zero, "overlap"
            offset = prev_end + prev_step - start
            restarts += 1
        offsets[k] = offset
        prev_end, prev_step = end + offset, step
    return offsets, ("restart" if restarts else "consecutive") if mode == "auto" else "join"


def placement_note(how: str, names: list[str], source: str) -> str:
    """What `place_files` did, in words (the report's header and `inspect` print it)."""
    n = len(names)
    shown = ", ".join(sorted(names, key=natural_key)[:4]) + (", ..." if n > 4 else "")
    if how == "consecutive":
        return f"{n} files of {source} joined by time (consecutive parts, one clock)"
    if how == "restart":
        return (
            f"{n} files of {source} joined by time in name order ({shown}): their clocks "
            "restart at zero, so each part is placed after the one before (if they are "
            "simultaneous, one per server, give --files merge)"
        )
    if how == "join":
        return f"{n} files of {source} joined by time in name order ({shown}) (--files join)"
    if how == "merge":
        return f"{n} files of {source} merged by arrival time on their own clocks (--files merge)"
    return f"{n} files of {source} overlap in time: merged by arrival time"


def _concat(streams: list[RequestStream], source: str, mode: str = "auto") -> RequestStream:
    """Several files of one format on one clock (`place_files`): parts of a trace split
    by time are joined, whether each part keeps the trace's clock or restarts at zero;
    files that overlap in time (one per server) are merged; the note says which."""
    if len(streams) == 1:
        return streams[0]
    epochs = [s.start_epoch_s for s in streams]
    origins = [e if e is not None else s.origin_s for s, e in zip(streams, epochs, strict=True)]
    if any(e is not None for e in epochs) and not all(e is not None for e in epochs):
        origins = [s.origin_s for s in streams]  # mixed clocks: each file's own numbers
    spans = [
        (Path(s.source).name, o, o + s.duration_s, s.duration_s / max(s.num_requests - 1, 1))
        for s, o in zip(streams, origins, strict=True)
    ]
    offsets, how = place_files(spans, mode)
    note = placement_note(how, [s[0] for s in spans], source)
    log.info(note)
    t = np.concatenate([
        s.arrival_s + o + off for s, o, off in zip(streams, origins, offsets, strict=True)
    ])  # fmt: skip
    order = np.argsort(t, kind="stable")
    prefix: list[list[int]] | None = None
    if all(s.prefix_ids is not None for s in streams):
        flat = [p for s in streams for p in (s.prefix_ids or [])]
        prefix = [flat[k] for k in order]
    known = [e for e in epochs if e is not None]
    first = float(t[order[0]])
    return RequestStream(
        arrival_s=t[order] - first,
        input_tokens=np.concatenate([s.input_tokens for s in streams])[order],
        output_tokens=np.concatenate([s.output_tokens for s in streams])[order],
        prefix_ids=prefix,
        source=source,
        start_epoch_s=min(known) if len(known) == len(streams) and how != "restart" else None,
        notes=[note],
        origin_s=first,
    )


MAX_GAP_S = servegen.MAX_GAP_WINDOWS * 600.0  # a longer silence in a request trace is real
GAP_OUTLIER = 10.0  # a hole is this many times longer than the trace's 99.9th-percentile gap
MIN_GAP_NEIGHBOUR_REQUESTS = 20  # requests on each side of a hole, within its length
MAX_GAP_SHARE = 0.05  # silences covering more of the trace are its own pattern (bursts)


def close_recording_gaps(stream: RequestStream) -> RequestStream:
    """A request trace with its recording gaps closed.

    A hole is a silence between two requests (at most ``MAX_GAP_S``) that the trace's
    own arrivals do not explain: ``GAP_OUTLIER`` times longer than its 99.9th-percentile
    inter-arrival time (a bursty trace's real silences set that percentile high, so they
    stay), with ``MIN_GAP_NEIGHBOUR_REQUESTS`` requests or more on each side within the
    hole's length (a silence that starts a quiet night stays). Replayed, it would read as
    demand falling to nothing and coming back. Every later arrival moves earlier by the
    hole's length less one mean inter-arrival time of its neighbours, so the trace reads
    as if the hole had not been there; the note counts the holes and the time removed.
    Silences that cover more than ``MAX_GAP_SHARE`` of the trace together are its own
    pattern (bursts with quiet between them), not holes: none is closed then.
    """
    n = stream.num_requests
    if n < 1000:  # too few gaps for a 99.9th percentile
        return stream
    t = stream.arrival_s
    gaps = np.diff(t)
    limit = GAP_OUTLIER * float(np.quantile(gaps, 0.999))
    shifts = np.zeros(n)
    holes, removed = 0, 0.0
    for i in np.flatnonzero((gaps > limit) & (gaps <= MAX_GAP_S)):
        g = float(gaps[i])
        before = i + 1 - int(np.searchsorted(t, t[i] - g))
        after = int(np.searchsorted(t, t[i + 1] + g, side="right")) - (i + 1)
        if min(before, after) < MIN_GAP_NEIGHBOUR_REQUESTS:
            continue
        shift = g - 2 * g / (before + after)  # keep one mean inter-arrival time
        shifts[i + 1 :] += shift
        holes, removed = holes + 1, removed + shift
    if not holes or removed > MAX_GAP_SHARE * stream.duration_s:
        return stream
    note = (
        f"{holes} recording gap(s) closed ({removed:,.0f} s in all without a single request, "
        f"each over {GAP_OUTLIER:g}x the trace's 99.9th-percentile inter-arrival time "
        f"({limit:.3g} s) and at most {MAX_GAP_S:g} s, between periods of normal demand): "
        "later arrivals moved earlier by each gap's length"
    )
    log.warning("%s: %s", stream.source, note)
    return replace(stream, arrival_s=t - shifts, notes=[*stream.notes, note])
