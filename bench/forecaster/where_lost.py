"""Where the policies lose SLO on ServeGen m-large: at jumps, or in steady bins?

Run from the repository root after `run.py servegen` (about 1 minute on 2 cores):

    uv run python bench/forecaster/where_lost.py

A diagnostic of the test half, after the fact (it chooses nothing): the HPA, predictive,
predictive+floor and the oracle are re-simulated at the settings `eval` chose on the training half (read
from each case's results.json), and every request that misses the SLO is charged to
its 10-minute bin, classified by how demand moved from the previous bin (a jump up of
more than 20%, up 5-20%, within 5%, down). Writes
bench/results/forecaster/where-lost.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from hybridllm_forecaster import evaluate, forecast, loaders
from hybridllm_forecaster.capacity import DEFAULT_POOLS

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path("../shared/traces/servegen-2025/m-large")
OUT = Path("bench/results/forecaster/where-lost.md")
CASES = {"servegen-m-large": 180.0, "servegen-m-large-cold600": 600.0}
CLASSES = (("jump up > 20%", 0.2, np.inf), ("up 5-20%", 0.05, 0.2),
           ("within 5%", -0.05, 0.05), ("down > 5%", -np.inf, -0.05))  # fmt: skip


def main() -> int:
    os.chdir(ROOT)
    demand, _ = loaders.load_demand(TRACE, loaders.detect_format(TRACE))
    n, split = demand.num_bins, demand.num_bins // 2
    lines = ["# Where the SLO is lost (ServeGen m-large, test half)\n",
             "Command: `uv run python bench/forecaster/where_lost.py` (a diagnostic: settings "
             "are those `eval` chose on the training half). Share of all test requests that "
             "miss the SLO, charged to the 10-minute bin they arrive in, by how demand moved "
             "from the previous bin.\n"]  # fmt: skip
    for case, cold in CASES.items():
        data = json.loads((Path("bench/results/forecaster") / case / "results.json").read_text())
        pol = {p["policy"]: p for p in data["policies"]}
        model = data["verdict"]["forecast"]["chosen_model"]
        pool = DEFAULT_POOLS["monolithic"].with_(cold_start_s=cold)
        work = pool.work_series(demand)
        horizon = max(1, int(np.ceil(pool.lead_time_s / demand.bin_s))) + 1
        rate = demand.req_per_s[split:]
        change = np.log(np.maximum(work[split:], 1e-9) / np.maximum(work[split - 1 : -1], 1e-9))
        share = {name: float(np.sum(rate[_mask(change, lo, hi)]) / np.sum(rate))
                 for name, lo, hi in CLASSES}  # fmt: skip
        lines += [f"\n## {case} (cold start {cold:g} s)\n",
                  "| policy (setting) | SLO | " + " | ".join(
                      f"lost in '{c}' bins ({100 * share[c]:.0f}% of requests)"
                      for c, _, _ in CLASSES) + " |",
                  "|---|---|" + "---|" * len(CLASSES)]  # fmt: skip
        for fam in ("hpa", "predictive", "predictive+floor", "oracle"):
            p = pol[fam]
            q = float(p["plans_for"][1:]) / 100 if p.get("plans_for") else 0.9
            spec = forecast.ForecastSpec(
                bin_s=demand.bin_s, horizon=horizon, upper_q=q, train_until=split,
                start_epoch_s=demand.start_epoch_s,
            )  # fmt: skip
            fc = forecast.run_model(model, work, spec)
            upper = fc.p50 if q == 0.5 else fc.upper
            r = evaluate._simulate_part(
                demand, None, work, upper, pool, fam, p["setting"], split, "test", "fluid",
                p["scale_down_window_s"],
            )  # fmt: skip
            steps = int(demand.bin_s // pool.control_interval_s)
            miss = (1.0 - r.attainment[: (n - split) * steps]).reshape(-1, steps).mean(axis=1)
            lost = miss * rate
            total = float(np.sum(rate))
            cells = [f"{100 * np.sum(lost[_mask(change, lo, hi)]) / total:.1f}%"
                     for _, lo, hi in CLASSES]  # fmt: skip
            knobs = f"{p['setting']:g}, {p.get('plans_for') or ''} {p['scale_down_window_s']:g} s"
            lines.append(f"| {fam} ({knobs}) | {100 * r.slo_attainment:.1f}% | "
                         + " | ".join(cells) + " |")  # fmt: skip
            print(lines[-1], flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    return 0


def _mask(change: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return (change > np.log1p(lo) if np.isfinite(lo) else True) & (
        change <= np.log1p(hi) if np.isfinite(hi) else True
    )


if __name__ == "__main__":
    sys.exit(main())
