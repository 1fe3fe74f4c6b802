"""How often the rollout analysis aborts a rollout it should not (A/A), and how often it
catches a worse canary (A/B), over many simulated rollouts.

Each rollout runs the default steps (10% and 50%, each held ``--pause`` seconds and
looked at every ``--interval`` seconds, early looks at significance/10, the last at the
significance; the 100% step has only the absolute bounds and is left out). At each look,
both revisions' windows hold every request since the step began, drawn from the same
latency and error distributions (A/A) or with the canary made slower or more error-prone
(A/B), put into the gateway's own histogram buckets, and judged by
``hybridllm_operator.llmservice.analysis.judge`` with the spec's defaults: the very code the
operator runs. A rollout is a false abort if any look of any step fails.

The latency distributions are heavy-tailed on purpose: a lognormal body (TTFT median
250 ms, sigma 0.6; time per output token median 30 ms, sigma 0.3) with 3% of requests
four times slower (a long prompt, a cold cache), and 0.5% of attempts failing.

    uv run python bench/rollout/analysis.py            # writes bench/results/rollout-analysis.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from hybridllm_common import crd
from hybridllm_common.metrics import LATENCY_BUCKETS, TPOT_BUCKETS
from hybridllm_operator.llmservice import analysis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from procs import machine

ROOT = Path(__file__).resolve().parents[2]
HOLD_FACTOR = 3  # an inconclusive step is followed this many pauses longer


def _hist(samples: np.ndarray, bounds: tuple[float, ...]) -> dict[float, float]:
    edges = [*bounds, float("inf")]
    counts = np.searchsorted(np.sort(samples), edges, side="right")
    return {le: float(c) for le, c in zip(edges, counts, strict=True)}


def _draw(rng: np.random.Generator, n: int, slow: float, errors: float) -> tuple:
    tail = rng.random(n) < 0.03
    ttft = rng.lognormal(np.log(0.25), 0.6, n) * np.where(tail, 4.0, 1.0) * slow
    tpot = rng.lognormal(np.log(0.03), 0.3, n) * np.where(tail, 4.0, 1.0) * slow
    failed = rng.random(n) < errors
    return ttft, tpot, failed


def one_rollout(
    rng: np.random.Generator,
    rate: float,
    pause: float,
    interval: float,
    slow: float,
    errors: float,
    spec: crd.RolloutAnalysis,
) -> tuple[str, float | None]:
    """(promoted, aborted or held, seconds into the rollout when it aborted)."""
    elapsed = 0.0
    for weight in (10, 50):
        sides = {"canary": ([], [], []), "stable": ([], [], [])}
        # looks through the pause, then on while the step is inconclusive (it holds), up
        # to HOLD_FACTOR pauses more
        looks = np.arange(interval, pause * (1 + HOLD_FACTOR) + 1e-9, interval)
        last = 0.0
        for t in looks:
            for side, share, s, e in (
                ("canary", weight / 100, slow, errors),
                ("stable", 1 - weight / 100, 1.0, 0.005),
            ):
                n = rng.poisson(rate * share * (t - last))
                for acc, new in zip(sides[side], _draw(rng, n, s, e), strict=True):
                    acc.append(new)
            last = t
            windows = {}
            for side, (ttft, tpot, failed) in sides.items():
                tt, tp, fl = (
                    np.concatenate(x) if x else np.array([]) for x in (ttft, tpot, failed)
                )
                ok = tt[~fl.astype(bool)] if len(fl) else tt
                windows[side] = analysis.RevisionWindow(
                    ok=float((~fl.astype(bool)).sum()),
                    errors=float(fl.sum()),
                    ttft=_hist(ok, LATENCY_BUCKETS),
                    tpot=_hist(tp[~fl.astype(bool)] if len(fl) else tp, TPOT_BUCKETS),
                )
            final = t >= pause - 1e-9
            alpha = spec.significance if final else spec.significance / 10
            verdict = analysis.judge(windows["canary"], windows["stable"], spec, alpha)
            if verdict.outcome == analysis.FAIL:
                return "aborted", elapsed + t
            if final and verdict.outcome == analysis.PASS:
                break
        else:
            return "held", None  # still inconclusive after HOLD_FACTOR more pauses
        elapsed += last
    return "promoted", None


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--pause", type=float, default=300.0, help="seconds per step (default spec)")
    ap.add_argument("--interval", type=float, default=30.0, help="analysis interval (default spec)")
    ap.add_argument("--rates", default="0.5,5,50", help="requests per second to the service")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/rollout-analysis")
    args = ap.parse_args()
    spec = crd.RolloutAnalysis()
    rng = np.random.default_rng(args.seed)
    cases = (
        [("A/A (same revision)", 1.0, 0.005)]
        + [(f"canary {int(100 * (s - 1))}% slower", s, 0.005) for s in (1.1, 1.25, 1.5, 2.0)]
        + [("canary failing 5% of attempts", 1.0, 0.05)]
    )
    rows = []
    t0 = time.time()
    for rate in (float(r) for r in args.rates.split(",")):
        for name, slow, errors in cases:
            ends: dict[str, int] = {"promoted": 0, "aborted": 0, "held": 0}
            when = []
            for _ in range(args.rollouts):
                end, at = one_rollout(rng, rate, args.pause, args.interval, slow, errors, spec)
                ends[end] += 1
                if at is not None:
                    when.append(at)
            aborts = ends["aborted"]
            rows.append(
                {
                    "rate_rps": rate,
                    "case": name,
                    "rollouts": args.rollouts,
                    "abort_rate": aborts / args.rollouts,
                    "held_rate": ends["held"] / args.rollouts,
                    "median_abort_s": float(np.median(when)) if when else None,
                }
            )
            print(f"{rate:>5} req/s  {name:<32} aborted {aborts}/{args.rollouts}", file=sys.stderr)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "uv run python bench/rollout/analysis.py " + " ".join(sys.argv[1:])
    meta = {
        "command": command.strip(),
        "machine": machine(),
        "python": platform.python_version(),
        "seconds": round(time.time() - t0, 1),
        "spec": spec.to_wire(),
        "pause_s": args.pause,
        "interval_s": args.interval,
        "seed": args.seed,
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# Rollout analysis: false aborts (A/A) and detection (A/B)",
        "",
        f"Command: `{meta['command']}` ({meta['seconds']} s on {meta['machine']['cpu']}, "
        f"{meta['machine']['cores']} cores, {meta['machine']['ram_gib']} GiB, Python {meta['python']}).",
        "",
        f"Each row is {args.rollouts} simulated rollouts through the default steps (10% and 50%, "
        f"{args.pause:.0f} s each, a look every {args.interval:.0f} s: early looks at significance/10, "
        "the last at the significance; a step still inconclusive then holds and is looked at on, "
        f"here for up to {HOLD_FACTOR} pauses more), judged by `hybridllm_operator.llmservice.analysis.judge` with the "
        "default `spec.rollout.analysis` (significance 0.01, maxLatencyIncrease 0.2, minRequests 50, "
        "maxErrorRate 0.02). Latencies are heavy-tailed (lognormal TTFT median 250 ms sigma 0.6, time "
        "per token median 30 ms sigma 0.3, 3% of requests 4x slower); the stable revision fails "
        "0.5% of attempts. Each metric is tested at a third of the significance (Bonferroni). No "
        "peer is run: Flagger and Argo Rollouts' built-in providers judge a canary by thresholds "
        "on queries (Argo's Kayenta provider tests differences, behind a service of its own); "
        "this file measures our own decision rule.",
        "",
        "| requests/s | case | rollouts aborted | still held (too few requests) | median time to abort (s) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        when = f"{r['median_abort_s']:.0f}" if r["median_abort_s"] is not None else "-"
        lines.append(
            f"| {r['rate_rps']:g} | {r['case']} | {100 * r['abort_rate']:.1f}% | "
            f"{100 * r['held_rate']:.1f}% | {when} |"
        )
    aa = [r["abort_rate"] for r in rows if r["case"].startswith("A/A")]
    lines += [
        "",
        f"Target: A/A aborts at most 5% of rollouts. Worst A/A rate here: {100 * max(aa):.1f}%.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
