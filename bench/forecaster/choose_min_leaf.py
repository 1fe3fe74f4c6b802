"""Choose the gbm's smallest leaf (`forecast.GBM_MIN_LEAF`) on the training halves only.

Run from the repository root (about 3 minutes on 2 cores):

    uv run python bench/forecaster/choose_min_leaf.py

For every development trace of `run.py` (each with its case's cold start and replica
size), the work series is cut at the train/test split *before* anything is fitted, so
the test half is never read. The gbm runs on rolling origins over the training half as
in `eval` (online refits, each seeing only earlier bins) with each candidate leaf size;
its forecasts are scored on the last third of the training half, the validation window
`eval` also uses to pick the model: P90 pinball loss (the quantile the model is chosen
by) and WAPE of the median at the horizon the policy reads, each over the last value's
on the same origins. The leaf with the lowest geometric mean of the pinball ratio over
the traces wins; ServeGen, the main development set, is shown separately. Writes
bench/results/forecaster/min-leaf.md.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import machine

from hybridllm_forecaster import evaluate, forecast, loaders, metrics, policies
from hybridllm_forecaster.capacity import DEFAULT_POOLS

ROOT = Path(__file__).resolve().parents[2]
TRACES = Path("../shared/traces")
OUT = Path("bench/results/forecaster/min-leaf.md")
LEAVES = (5, 10, 20, 40)
# case -> (trace, cold start s, capacity scale, simulator the eval uses)
CASES = {
    "servegen-m-large": (TRACES / "servegen-2025/m-large", 180.0, 1.0, "fluid"),
    "servegen-m-large-cold600": (TRACES / "servegen-2025/m-large", 600.0, 1.0, "fluid"),
    "azure-code": (TRACES / "azure-2023/AzureLLMInferenceTrace_code.csv", 180.0, 1.0, "des"),
    "azure-conv": (TRACES / "azure-2023/AzureLLMInferenceTrace_conv.csv", 180.0, 1.0, "des"),
    "mooncake-conversation": (TRACES / "mooncake-2025/conversation_trace.jsonl", 180.0, 1.0,
                              "des"),
    "swe-agent-sessions": (TRACES / "swe-agent", 180.0, 1.0, "fluid"),
}  # fmt: skip


def score_case(trace: Path, cold: float, scale: float, simulator: str) -> dict[str, object]:
    demand, _ = loaders.load_demand(trace, loaders.detect_format(trace))
    pool = DEFAULT_POOLS["monolithic"].with_(cold_start_s=cold)
    if scale != 1.0:
        pool = pool.with_(capacity=pool.capacity.scaled(scale))
    split = round(demand.num_bins * 0.5)
    y = pool.work_series(demand)[:split]  # the test half is cut off here
    scale_up_h = max(1, math.ceil(pool.lead_time_s / demand.bin_s))
    observed = demand.bin_s if simulator == "des" else (
        pool.control_interval_s + policies.METRIC_DELAY_S
    )  # fmt: skip
    h = evaluate.policy_horizon(pool.lead_time_s, demand.bin_s, observed)
    spec = forecast.ForecastSpec(
        bin_s=demand.bin_s, horizon=scale_up_h + 1, upper_q=0.9, train_until=split,
        min_train=min(48, max(12, split // 2)), start_epoch_s=demand.start_epoch_s,
    )  # fmt: skip
    lo = split - max(8, split // 3)
    origins = np.arange(max(0, lo - h), split - h)
    actual = y[origins + h]
    last = forecast.run_model("last", y, spec)
    base_pin = metrics.pinball(actual, last.upper[origins, h - 1], 0.9)
    base_wape = metrics.wape(actual, last.p50[origins, h - 1])
    out: dict[str, object] = {"h": h, "bin_s": demand.bin_s, "points": len(origins)}
    for leaf in LEAVES:
        forecast.GBM_MIN_LEAF = leaf
        fc = forecast.run_model("gbm", y, spec)
        out[leaf] = (
            metrics.pinball(actual, fc.upper[origins, h - 1], 0.9) / base_pin,
            metrics.wape(actual, fc.p50[origins, h - 1]) / base_wape,
        )
    out["last"] = (base_pin, base_wape)
    return out


def main() -> int:
    os.chdir(ROOT)
    started = time.monotonic()
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    default = forecast.GBM_MIN_LEAF
    results = {}
    for name, (trace, cold, scale, sim) in CASES.items():
        print(f"== {name}", flush=True)
        results[name] = score_case(trace, cold, scale, sim)
    forecast.GBM_MIN_LEAF = default
    geo = {
        leaf: math.exp(np.mean([math.log(r[leaf][0]) for r in results.values()])) for leaf in LEAVES
    }
    best = min(LEAVES, key=lambda leaf: geo[leaf])
    lines = [
        "# The gbm's smallest leaf, chosen on the training halves\n",
        f"Machine: {machine()}; load average {load_start} at the start, "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + f" at the end; ran {time.monotonic() - started:.0f} s. Command: "
        "`uv run python bench/forecaster/choose_min_leaf.py`. Each cell: gbm P90 pinball / "
        "last value's P90 pinball, then gbm WAPE / last value's WAPE, on the last third of "
        "the training half at the horizon the policy reads (lower is better; < 1 beats the "
        "last value, the peer computed in the same run). The test halves are never read.\n",
        "| case | horizon | validation points | "
        + " | ".join(f"leaf {leaf}" for leaf in LEAVES)
        + " | last value (pinball, WAPE) |",
        "|---|---|---|" + "---|" * len(LEAVES) + "---|",
    ]
    for name, r in results.items():
        cells = " | ".join(f"{r[leaf][0]:.4g}, {r[leaf][1]:.4g}" for leaf in LEAVES)
        lp, lw = r["last"]
        lines.append(
            f"| {name} | {r['h'] * r['bin_s'] / 60:g} min | {r['points']} | {cells} "
            f"| {lp:.4g}, {100 * lw:.1f}% |"
        )
    lines.append(
        "| geometric mean (pinball ratio) | | | "
        + " | ".join(f"{geo[leaf]:.4g}" for leaf in LEAVES)
        + " | |"
    )
    lines.append(f"\nChosen: leaves of {best} (the lowest geometric mean pinball ratio).\n")
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
