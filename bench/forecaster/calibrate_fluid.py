"""How far the fluid simulator's queueing is from the per-request simulator, on ServeGen.

Run from the repository root (about 4 minutes on 2 cores):

    uv run python bench/forecaster/calibrate_fluid.py

For windows of ServeGen m-large picked by their inter-arrival CV (quantiles 0.1, 0.5,
0.75, 0.9 and 0.97 of each half of the trace), requests are sampled at the trace's full
rate (`servegen.sample_requests`), and a fixed pool is sized to utilisations 0.5-0.9 of
the default replica. The per-request simulator (`des.py`) gives the reference SLO
attainment; the fluid (`fluid.py`) gives its approximation for the same window and
replica count. The fluid's constants (``KINGMAN_K``, ``THIN_POWER``, ``TBT_BIAS``,
``TBT_SPREAD``) were fitted by a grid search on the test-half windows; the
training-half windows are a check on windows the fit never saw. Writes
bench/results/forecaster/fluid-calibration.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from hybridllm_forecaster import des, fluid, policies, servegen
from hybridllm_forecaster.capacity import PoolConfig

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path("../shared/traces/servegen-2025/m-large")
OUT = Path("bench/results/forecaster/fluid-calibration.md")
UTILISATIONS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)
CV_QUANTILES = (0.1, 0.5, 0.75, 0.9, 0.97)


class Fixed(policies.Policy):
    name = "fixed"

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, obs: policies.Observation) -> int:
        return self.replicas


def rows_for(w: servegen.Windows, windows: list[int], pool: PoolConfig) -> list[dict]:
    rows = []
    for i in windows:
        sub = servegen.Windows(w.window_s, w.rate[i : i + 1], w.cv2[i : i + 1], 1, w.source)
        demand = servegen.to_demand(sub)
        stream = servegen.sample_requests(sub, seed=1)
        work = float(pool.work_series(demand)[0])
        for u in UTILISATIONS:
            n = pool.replicas_for(work, u)
            ref = des.simulate_des(stream, pool, Fixed(n), initial_replicas=n)
            approx = fluid.simulate_fluid(demand, pool, Fixed(n), initial_replicas=n)
            rows.append({
                "window": i, "cv": float(np.sqrt(w.cv2[i])), "replicas": n, "utilisation": work / n,
                "des": ref.slo_attainment, "fluid": approx.slo_attainment,
            })  # fmt: skip
            print(f"window {i} cv {rows[-1]['cv']:.2f} u {u}: des {ref.slo_attainment:.4f} "
                  f"fluid {approx.slo_attainment:.4f}", flush=True)  # fmt: skip
    return rows


def pick(w: servegen.Windows, lo: int, hi: int) -> list[int]:
    idx = np.arange(lo, hi)
    order = idx[np.argsort(np.sqrt(w.cv2[idx]))]
    return [int(order[int(len(order) * q)]) for q in CV_QUANTILES]


def main() -> int:
    import os

    os.chdir(ROOT)
    sys.path.insert(0, str(Path(__file__).parent))
    from run import machine  # the same machine line as the benchmark summary

    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.monotonic()
    w = servegen.load_windows(TRACE)
    pool = PoolConfig()
    half = len(w.rate) // 2
    parts = {
        "test half (fitted on)": rows_for(w, pick(w, half, len(w.rate)), pool),
        "training half (check)": rows_for(w, pick(w, 0, half), pool),
    }
    lines = [
        "# Fluid simulator vs per-request simulator (ServeGen m-large windows)\n",
        f"Command: `uv run python bench/forecaster/calibrate_fluid.py` ({time.strftime('%Y-%m-%d')}, "
        f"{time.monotonic() - started:.0f} s). Machine: {machine()}; load average "
        f"{load_start} at the start, {', '.join(f'{x:.2f}' for x in os.getloadavg())} at "
        "the end. Each row: one 10-minute window sampled at the "
        "trace's full rate, a fixed pool of the default replica, SLO TTFT 2 s / TBT 0.1 s. "
        "Attainment in %. The simulations are seeded and deterministic.\n",
    ]
    for name, rows in parts.items():
        err = np.array([r["fluid"] - r["des"] for r in rows])
        low = np.array([r["utilisation"] <= 0.86 for r in rows])
        lines += [
            f"\n## {name}: mean absolute error {100 * np.mean(np.abs(err)):.1f} points "
            f"({100 * np.mean(np.abs(err[low])):.1f} up to utilisation 0.85)\n",
            "| window | arrival CV | replicas | utilisation | per-request | fluid | fluid - DES |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['window']} | {r['cv']:.2f} | {r['replicas']} | {r['utilisation']:.2f} | "
            f"{100 * r['des']:.1f} | {100 * r['fluid']:.1f} | {100 * (r['fluid'] - r['des']):+.1f} |"
            for r in rows
        ]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
