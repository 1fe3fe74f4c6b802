"""Plots an on-call engineer reads at a glance: demand, forecast, replicas per policy, cost.

`timeline.png`: top, the work demand (in replicas at 100% busy) and the forecast's
median and upper quantile at the scale-up horizon; middle, replicas paid for by each
policy over the same demand line; bottom, SLO attainment per interval. A second,
zoomed copy covers the day around the steepest rise of the test period.
`frontier.png`: SLO attainment against replica-hours for every policy setting on the
test period, the chosen setting of each family circled.
`forecast_errors.png`: WAPE per horizon per model.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from hybridllm_forecaster.evaluate import EvalResult

COLOURS = {
    "hpa": "tab:red",
    "hpa-tuned": "tab:brown",
    "keda-queue": "tab:orange",
    "predictive": "tab:blue",
    "predictive+floor": "tab:green",
    "oracle": "tab:purple",
}


def write_all(res: EvalResult, out_dir: Path, title: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _timeline(res, out_dir / "timeline.png", title, zoom=False),
        _timeline(res, out_dir / "timeline_zoom.png", title, zoom=True),
        _frontier(res, out_dir / "frontier.png", title),
        _errors(res, out_dir / "forecast_errors.png", title),
    ]
    return paths


def _hours(h: float) -> str:
    return f"{h:,.0f}" if h >= 100 else f"{h:.3g}"


def _hours_axis(seconds: np.ndarray) -> tuple[np.ndarray, str]:
    if seconds.size and seconds[-1] > 2 * 86_400:
        return seconds / 86_400, "days into test period"
    if seconds.size and seconds[-1] > 3 * 3600:
        return seconds / 3600, "hours into test period"
    return seconds / 60, "minutes into test period"


def _timeline(res: EvalResult, path: Path, title: str, zoom: bool) -> Path:
    bin_s = res.demand.bin_s
    test_work = res.work[res.split :]
    t_bins = np.arange(len(test_work)) * bin_s
    h = res.scale_up_h
    fc = res.forecasts[res.chosen_model]
    origins = np.arange(res.split - h, res.demand.num_bins - h)
    p50 = fc.p50[origins, h - 1]
    upper = fc.upper[origins, h - 1]
    hpa = res.test_result("hpa")
    lo_s, hi_s = 0.0, t_bins[-1] + bin_s
    if zoom:
        window = min(86_400.0, hi_s / 4)
        per = max(1, int(window // bin_s))
        rise = np.convolve(np.diff(test_work, prepend=test_work[0]), np.ones(per // 4 + 1), "same")
        centre = float(np.argmax(rise) * bin_s)
        lo_s = max(0.0, centre - window / 2)
        hi_s = min(hi_s, lo_s + window)
    fig, axes = plt.subplots(3, 1, figsize=(13, 9), sharex=True, height_ratios=[2, 2, 1])
    x, xlabel = _hours_axis(t_bins)
    scale = x[1] / t_bins[1] if len(t_bins) > 1 and t_bins[1] > 0 else 1.0
    ax = axes[0]
    ax.step(x, test_work, where="post", color="black", lw=1.2, label="actual demand")
    ax.step(
        x, p50, where="post", color="tab:blue", lw=1, label=f"forecast P50 ({res.chosen_model})"
    )
    ax.step(x, upper, where="post", color="tab:blue", lw=1, ls="--",
            label=f"forecast P{round(fc.upper_q * 100)}")  # fmt: skip
    ax.set_ylabel("demand\n(replicas at 100% busy)")
    ax.set_title(f"{title}: forecast {h * bin_s / 60:.3g} min ahead (the scale-up lead time)")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[1]
    ax.step(x, test_work, where="post", color="black", lw=1, ls=":", label="demand")
    top = 1.25 * max(
        float(np.max(res.test_result(f).provisioned)) for f in COLOURS if f != "keda-queue"
    )
    for fam in ("hpa", "keda-queue", "predictive", "predictive+floor", "oracle"):
        r = res.test_result(fam)
        clipped = " (clipped)" if float(np.max(r.provisioned)) > top else ""
        label = (f"{fam}: {_hours(r.replica_hours)} replica-h, "
                 f"{100 * r.slo_attainment:.1f}% SLO{clipped}")  # fmt: skip
        ax.step(
            r.times_s * scale, r.provisioned, where="post", color=COLOURS[fam], lw=1, label=label
        )
    ax.set_ylim(0, top)
    ax.set_ylabel("replicas paid for")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[2]
    for fam in ("hpa", "predictive", "predictive+floor", "oracle"):
        r = res.test_result(fam)
        k = max(1, len(r.attainment) // 400)
        att = np.convolve(r.attainment, np.ones(k) / k, "same")
        ax.plot(r.times_s * scale, 100 * att, color=COLOURS[fam], lw=1, label=fam)
    ax.set_ylabel("SLO met (%)")
    ax.set_ylim(max(0.0, 100 * float(np.min(hpa.attainment)) - 5), 101)
    ax.set_xlabel(xlabel)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_xlim(lo_s * scale, hi_s * scale)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _frontier(res: EvalResult, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam, runs in res.test_runs.items():
        hours = [r.replica_hours for _, r in runs]
        att = [100 * r.slo_attainment for _, r in runs]
        ax.plot(hours, att, "o-", color=COLOURS[fam], label=fam, ms=4)
        for s, r in runs:
            ax.annotate(f"{s:g}", (r.replica_hours, 100 * r.slo_attainment), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
        chosen = res.test_result(fam)
        ax.plot(chosen.replica_hours, 100 * chosen.slo_attainment, "o", ms=11, mfc="none",
                color=COLOURS[fam])  # fmt: skip
    # zoom on the HPA's range: a runaway setting (a queue policy flapping) would squash it
    hpa_hours = [r.replica_hours for _, r in res.test_runs["hpa"]]
    hpa_att = [100 * r.slo_attainment for _, r in res.test_runs["hpa"]]
    all_hours = [r.replica_hours for runs in res.test_runs.values() for _, r in runs]
    ax.set_xlim(0.9 * min(all_hours), 1.3 * max(hpa_hours))
    ax.set_ylim(max(0.0, min(hpa_att) - 10.0), 100.5)
    ax.set_xlabel("replica-hours on the test period (cost)")
    ax.set_ylabel("requests within TTFT and TBT SLO (%)")
    ax.set_title(f"{title}: cost vs SLO\n(labels: target utilisation; circled: tuned on the "
                 "training period; up and left is better)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _errors(res: EvalResult, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    models = sorted({s.model for s in res.scores})
    for m in models:
        pts = sorted((s.horizon, s.wape) for s in res.scores if s.model == m)
        ax.plot(
            [p[0] * res.demand.bin_s / 60 for p in pts], [100 * p[1] for p in pts], "o-", label=m
        )
    ax.axvline(
        res.scale_up_h * res.demand.bin_s / 60, color="gray", ls=":", label="scale-up horizon"
    )
    ax.set_xlabel("minutes ahead")
    ax.set_ylabel("WAPE of P50 on test (%)")
    ax.set_title(f"{title}: forecast error by horizon")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
