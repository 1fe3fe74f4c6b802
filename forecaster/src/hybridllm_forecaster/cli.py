"""`hybridllm forecast ...`: evaluate forecasts and scaling policies on any supported trace.

``hybridllm forecast eval --trace PATH`` detects the format from the content, splits
the trace in time (train on the early part, test on the late part), prints the
forecast and policy tables and writes report.md, results.json and plots to ``--out``.
``hybridllm forecast inspect --trace PATH`` only loads the trace and summarises it.
Defaults describe a generic pool (see `capacity.py`), not the shipped traces.
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm_common import cli as common_cli
from hybridllm_forecaster import formats
from hybridllm_forecaster.capacity import DEFAULT_POOLS, PoolConfig, Slo
from hybridllm_forecaster.errors import TraceFormatError

log = logging.getLogger(__name__)

AUTO_MEAN_REPLICAS = 8.0  # --demand-scale auto: the mean load needs this many replicas


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("forecast", help=common_cli.summary("forecast"))
    sub = parser.add_subparsers(dest="forecast_command", metavar="ACTION", required=True)

    ev = sub.add_parser(
        "eval", help="compare forecasts and scaling policies on a trace",
        description="Compare forecasts and scaling policies on a trace. Exit status: 0, a "
        "comparison whose validity checks pass; 2, bad input; 3, the report is written but "
        "the comparison is not meaningful (saturated or idle pool, an SLO out of reach, no "
        "requests): it says why and gives no verdict.",
    )  # fmt: skip
    _trace_args(ev)
    ev.add_argument("--slo", default="2,0.1", metavar="TTFT_S[,TBT_S]",
                    help="SLO: time to first token and mean time between tokens, seconds "
                         "(also 'ttft=2,tbt=0.1'; default 2,0.1)")  # fmt: skip
    ev.add_argument("--pool", choices=sorted(DEFAULT_POOLS), default="monolithic")
    ev.add_argument("--cold-start", type=float, default=None, metavar="S",
                    help="seconds from scale-up to ready (default 180)")  # fmt: skip
    ev.add_argument("--demand-scale", default="1", metavar="X|auto",
                    help="size the trace's population: each request kept with probability "
                         "X (below 1) or jittered copies of the trace (above 1), request "
                         "sizes and the rate's shape unchanged; 'auto': the mean load needs "
                         f"{AUTO_MEAN_REPLICAS} replicas, where scaling decisions matter "
                         "(default 1)")  # fmt: skip
    ev.add_argument("--capacity-scale", default="1", metavar="X",
                    help="a replica X times as fast (prefill rate and the per-sequence "
                         "cost of a decode step; a faster or slower accelerator); default "
                         "1. To fit a trace's size use --demand-scale, which keeps every "
                         "request's latency the replica's own")  # fmt: skip
    ev.add_argument("--min-replicas", type=int, default=None, metavar="N",
                    help="the pool's floor (default 1)")  # fmt: skip
    ev.add_argument("--max-replicas", type=int, default=None, metavar="N",
                    help="the pool's ceiling (default 1000)")  # fmt: skip
    ev.add_argument("--train-frac", type=float, default=0.5, help="share of time used to train")
    ev.add_argument(
        "--model", default="auto", choices=["auto", "last", "seasonal", "holt-winters", "gbm"]
    )
    ev.add_argument("--simulator", default="auto", choices=["auto", "des", "fluid"])
    ev.add_argument("--out", type=Path, default=None, help="folder for report and plots")
    ev.set_defaults(func=run_eval)

    ins = sub.add_parser("inspect", help="detect a trace's format and summarise it")
    _trace_args(ins)
    ins.set_defaults(func=run_inspect)


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="trace file or folder")
    p.add_argument("--format", default=None, help=f"one of {', '.join(formats.FORMATS)} "
                   "(default: detected from the content)")  # fmt: skip
    p.add_argument("--bin-s", type=float, default=None, help="forecast bin width in seconds")
    p.add_argument("--mean-input-tokens", type=float, default=None,
                   help="rate-only traces (ServeGen): mean prompt length to assume")  # fmt: skip
    p.add_argument("--mean-output-tokens", type=float, default=None,
                   help="rate-only traces (ServeGen): mean output length to assume")  # fmt: skip
    p.add_argument("--files", choices=["auto", "join", "merge"], default="auto",
                   help="a folder of several files of one trace: 'join' them in name order, "
                        "each after the one before (parts of a trace split by time); "
                        "'merge' them on their own clocks (one per server); 'auto' (default) "
                        "decides from the timestamps and says which it did")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)


def parse_slo(text: str) -> Slo:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    values: dict[str, float] = {}
    try:
        for k, part in enumerate(parts):
            if "=" in part:
                key, val = part.split("=", 1)
                values[key.strip().lower()] = float(val)
            else:
                values[("ttft", "tbt")[k]] = float(part)
    except (ValueError, IndexError) as exc:
        raise ValueError(f"--slo {text!r}: expected TTFT_S[,TBT_S] or ttft=S,tbt=S") from exc
    unknown = set(values) - {"ttft", "tbt"}
    if unknown:
        raise ValueError(f"--slo {text!r}: unknown keys {sorted(unknown)}")
    default = Slo()
    return Slo(values.get("ttft", default.ttft_s), values.get("tbt", default.tbt_s))


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from hybridllm_forecaster import loaders

    fmt = formats.normalise_format(args.format) or loaders.detect_format(args.trace)
    kwargs = {}
    if args.mean_input_tokens:
        kwargs["mean_input_tokens"] = args.mean_input_tokens
    if args.mean_output_tokens:
        kwargs["mean_output_tokens"] = args.mean_output_tokens
    demand, stream = loaders.load_demand(
        args.trace, fmt, bin_s=args.bin_s, seed=args.seed, files=args.files, **kwargs
    )
    return fmt, (demand, stream)


CAPACITY_SOURCE = (
    "capacity model: parametric defaults of capacity.py (an 8B model on one H100: not "
    "calibrated on this trace's engine)"
)


def capacity_line(pool: PoolConfig, scale: float = 1.0) -> str:
    """The replica the comparison assumes, in words (the report's header and `inspect`)."""
    cap = pool.capacity
    return (
        f"{CAPACITY_SOURCE}, x{scale:.3g}: prefill {cap.prefill_tok_s:,.0f} tok/s in "
        f"{cap.prefill_chunk_tokens}-token chunks, decode step {1000 * cap.tbt_base_s:g} ms + "
        f"{1000 * cap.tbt_per_seq_s:g} ms per sequence, max batch {pool.max_batch} at the "
        f"SLO, decode {pool.decode_tok_s:,.0f} tok/s; pool {pool.name}"
    )


def simulator_line(choice: str, stream: Any, des_max_requests: int) -> str:
    """Which simulator `eval` uses and why (the header and `inspect`)."""
    if choice != "auto":
        return f"simulator: {choice} (--simulator {choice})"
    if stream is not None and stream.num_requests <= des_max_requests:
        return (
            f"simulator: des, per request ({stream.num_requests:,} requests, at most "
            f"{des_max_requests:,} for it)"
        )
    why = "a rate-only trace" if stream is None else f"{stream.num_requests:,} requests"
    return (
        f"simulator: fluid, 15 s steps with a calibrated queueing approximation ({why}; the "
        f"per-request simulator takes at most {des_max_requests:,})"
    )


def run_inspect(args: argparse.Namespace) -> int:
    from hybridllm_forecaster.evaluate import EvalConfig

    try:
        fmt, (demand, stream) = _load(args)
    except (TraceFormatError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.trace}: format {fmt}, {demand.num_bins} bins of {demand.bin_s:g} s "
          f"({demand.duration_s / 3600:.1f} h)")  # fmt: skip
    rpm = demand.req_per_s * 60
    print(f"requests/min: mean {rpm.mean():,.1f}, max {rpm.max():,.1f}")
    if stream is not None:
        print(f"{stream.num_requests} requests; input tokens mean "
              f"{stream.input_tokens.mean():.0f}, "
              f"output mean {stream.output_tokens.mean():.0f}")  # fmt: skip
    notes = [*(stream.notes if stream is not None else []), *demand.notes]
    gaps = [n for n in notes if "recording gap" in n]
    if not gaps:
        print("recording gaps: none found")
    for note in dict.fromkeys(notes):
        print(note)
    print("assumptions (what `forecast eval` would use with its defaults):")
    for line in (
        *demand.assumptions,
        capacity_line(DEFAULT_POOLS["monolithic"]),
        simulator_line(
            "auto", stream, EvalConfig(pool=DEFAULT_POOLS["monolithic"]).des_max_requests
        ),
    ):
        print(f"  {line}")
    return 0


def _positive(flag: str, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: {what}") from None
    if not value > 0:
        raise ValueError(f"{flag} {text}: must be positive")
    return value


def _scale_demand(args: argparse.Namespace, demand: Any, stream: Any) -> tuple[Any, Any, float]:
    """The trace sized by ``--demand-scale``: 'auto' puts the mean load at
    ``AUTO_MEAN_REPLICAS`` replicas of the pool's replica."""
    if args.demand_scale == "auto":
        mean_work = float(np.mean(DEFAULT_POOLS[args.pool].work_series(demand)))
        if mean_work <= 0:
            raise ValueError(f"{args.trace}: no demand to size (every bin is empty)")
        factor = AUTO_MEAN_REPLICAS / mean_work
    else:
        factor = _positive("--demand-scale", args.demand_scale, "a number or 'auto'")
    if factor == 1.0:
        return demand, stream, factor
    if stream is None:
        return demand.scaled(factor), None, factor
    scaled = stream.scaled(factor, seed=args.seed)
    if scaled.num_requests == 0:
        raise ValueError(f"--demand-scale {factor:.3g} leaves no request of {args.trace}")
    return scaled.to_demand(demand.bin_s), scaled, factor


def _pool(args: argparse.Namespace, demand: Any) -> tuple[PoolConfig, float]:
    pool = DEFAULT_POOLS[args.pool].with_(slo=parse_slo(args.slo))
    if args.cold_start is not None:
        pool = pool.with_(cold_start_s=args.cold_start)
    low = pool.min_replicas if args.min_replicas is None else args.min_replicas
    high = pool.max_replicas if args.max_replicas is None else args.max_replicas
    if not 1 <= low <= high:
        raise ValueError(f"--min-replicas {low} and --max-replicas {high}: need 1 <= min <= max")
    pool = pool.with_(min_replicas=low, max_replicas=high)
    if args.capacity_scale == "auto":
        raise ValueError(
            "--capacity-scale auto is gone: it made a replica slower or faster per request to "
            "fit the trace (light traces then missed every TTFT). Use --demand-scale auto, "
            "which sizes the trace and keeps each request's latency the replica's own"
        )
    scale = _positive("--capacity-scale", args.capacity_scale, "a number")
    if scale != 1.0:
        pool = pool.with_(capacity=pool.capacity.scaled(scale))
    return pool, scale


def run_eval(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from hybridllm_forecaster import evaluate, plots, report

    started = time.monotonic()
    try:
        fmt, (demand, stream) = _load(args)
        loaded_notes = list(demand.notes)  # what loading repaired (recording gaps)
        assumptions = list(demand.assumptions)  # where request lengths came from
        demand, stream, demand_scale = _scale_demand(args, demand, stream)
        pool, scale = _pool(args, demand)
    except (TraceFormatError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = evaluate.EvalConfig(pool=pool, train_frac=args.train_frac, model=args.model,
                              simulator=args.simulator)  # fmt: skip
    num_steps = evaluate.num_progress_steps(cfg)
    with Progress(transient=True) as bar:
        task = bar.add_task("evaluating", total=num_steps)

        def tick(msg: str) -> None:
            bar.update(task, advance=1, description=msg)

        try:
            res = evaluate.evaluate(demand, stream, cfg, progress=tick)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    name = args.trace.name if args.trace.name else str(args.trace)
    out = args.out or Path(f"forecast-eval-{args.trace.stem}")
    header = (
        f"trace `{args.trace}` (format {fmt}), {demand.num_bins} bins of {demand.bin_s:g} s "
        f"({demand.duration_s / 3600:.1f} h); pool {pool.name}, "
        f"cold start {pool.cold_start_s:g} s, lead time {pool.lead_time_s:g} s, "
        f"SLO TTFT {pool.slo.ttft_s:g} s / TBT {pool.slo.tbt_s:g} s; "
        f"demand x{demand_scale:.3g}; replica capacity x{scale:.3g} (prefill {pool.capacity.prefill_tok_s:,.0f} tok/s, decode "
        f"{pool.decode_tok_s:,.0f} tok/s, max batch {pool.max_batch}); simulator {res.simulator}; "
        f"train on the first {100 * args.train_frac:g}% of time, test on the rest; "
        f"machine {platform.node()} ({platform.processor() or platform.machine()}); "
        f"ran {time.monotonic() - started:.0f} s"
    )
    notes = [*(stream.notes if stream is not None else []), *loaded_notes]
    if not any("recording gap" in n for n in notes):
        notes.append("recording gaps: none found")
    header += "; " + "; ".join(dict.fromkeys(notes))
    sim = simulator_line(args.simulator, stream, cfg.des_max_requests)
    header += "\n\nAssumptions: " + "; ".join([*assumptions, capacity_line(pool, scale), sim])
    paths = plots.write_all(res, out, name)
    report.print_tables(res, header)
    md = report.write(res, out, header, paths)
    print(f"wrote {md}, {out / 'results.json'} and {len(paths)} plots")
    if report.comparison_problems(res):
        return report.EXIT_NOT_MEANINGFUL
    return 0
