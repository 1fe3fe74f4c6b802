"""Can per-client (hierarchical) forecasts predict the jumps the aggregate cannot?

Run from the repository root (about 1 minute on 2 cores):

    uv run python bench/forecaster/client_forecast.py

ServeGen m-large, *training half only* (the first 7 of 14 days; nothing here reads the
test half). The aggregate's big 10-minute moves are single clients switching on or off;
if those clients kept a daily schedule (batch jobs at fixed times), a forecast built from
each client's own history, in particular "what this client did next yesterday", would
see the jumps coming. Two measurements decide whether it is worth building:

1. Regularity: for the clients that carry most of the demand, and for those that cause
   the big moves, the share of the training days' "on" bins that coincide from one day to
   the next (Jaccard overlap of the daily on-sets, 1 = the same schedule every day), and
   the correlation of a client's move over the next h bins with its move at the same time
   yesterday.
2. Forecast value: the sum of per-client forecasts against the aggregate's last value and
   the aggregate gbm (`forecast.run_model`) at 1 and 2 bins ahead, WAPE on all bins and on
   the bins where the aggregate moves by more than 20%. Per-client forecasts:
   ``client+yesterday`` (each client's last value plus its move at the same time
   yesterday) and ``client-gbm``, one gradient-boosting model pooled over all clients
   (features: the client's last six bins, its rate at the same time yesterday and two days
   ago, at the origin and at the target time, how often it was on at the target time of
   day on earlier days, how long it has been in its current on/off state, its recent
   maximum; all rates over the aggregate at the origin; the target is the client's move
   over the aggregate). It is fitted on days 2-5 and scored on days 6-7 of the training
   half; the aggregate models are scored on the same origins.

Writes bench/results/forecaster/client-forecast.md.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.ensemble import HistGradientBoostingRegressor
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import machine

from hybridllm_forecaster import forecast, metrics, servegen

ROOT = Path(__file__).resolve().parents[2]
TRACE = Path("../shared/traces/servegen-2025/m-large")
OUT = Path("bench/results/forecaster/client-forecast.md")
DAY = 144  # 10-minute bins
FIT_END = 5 * DAY  # fit on origins before this (days 2-5: day 1 has no yesterday)
ON_FRAC = 0.05  # a client is "on" above this share of its own maximum rate
BIG_MOVE = 0.2


def client_matrix(split: int) -> np.ndarray:
    """[clients, bins] request rates of the training half, one row per client file."""
    files = [p for p in sorted(TRACE.glob("*.csv")) if not servegen._is_aggregate(p)]
    rows = []
    for f in files:
        start, rate, _ = servegen._read_file(f)
        r = np.zeros(split)
        idx = np.rint(start / 600.0).astype(int)
        keep = idx < split
        r[idx[keep]] = rate[keep]
        rows.append(r)
    return np.array(rows)


def features(r: np.ndarray, agg: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [clients * origins, k], target, origin index) for origins with a target."""
    c, n = r.shape
    t = np.arange(2 * DAY, n - h)
    scale = agg[t][None, :]
    on = r > ON_FRAC * np.maximum(r.max(axis=1, keepdims=True), 1e-12)
    cols = [r[:, t - k] / scale for k in range(6)]
    cols += [r[:, t - DAY + h] / scale, r[:, t - DAY] / scale, r[:, t - 2 * DAY + h] / scale]
    # how often on at the target's time of day on earlier days (only days before t)
    tod_on = np.zeros((c, len(t)))
    for j, ti in enumerate(t):
        past = np.arange(ti + h - DAY, -1, -DAY)
        tod_on[:, j] = on[:, past].mean(axis=1)
    cols.append(tod_on)
    run = np.zeros((c, n))  # bins since the client's on/off state last changed
    for i in range(1, n):
        run[:, i] = np.where(on[:, i] == on[:, i - 1], run[:, i - 1] + 1, 0)
    cols.append(np.minimum(run[:, t], 48))
    cols.append(np.array([r[:, max(0, ti - DAY) : ti + 1].max(axis=1) for ti in t]).T / scale)
    tod = 2 * np.pi * ((t + h) % DAY) / DAY
    cols += [np.broadcast_to(np.sin(tod), (c, len(t))), np.broadcast_to(np.cos(tod), (c, len(t)))]
    x = np.stack([col.reshape(-1) for col in cols], axis=1)
    y = ((r[:, t + h] - r[:, t]) / scale).reshape(-1)
    return x, y, np.broadcast_to(t, (c, len(t))).reshape(-1)


def jaccard_days(on: np.ndarray) -> float:
    days = on[: (len(on) // DAY) * DAY].reshape(-1, DAY)
    pairs = [
        (days[i] & days[j]).sum() / max(1, (days[i] | days[j]).sum())
        for i in range(len(days))
        for j in range(i + 1, len(days))
        if days[i].any() or days[j].any()
    ]
    return float(np.mean(pairs)) if pairs else float("nan")


def main() -> int:
    os.chdir(ROOT)
    started = time.monotonic()
    load_start = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    windows = servegen.load_windows(TRACE)
    split = len(windows.rate) // 2
    r = client_matrix(split)
    agg = r.sum(axis=0)
    assert np.allclose(agg, windows.rate[:split]), "client files do not sum to the aggregate"
    lines = [
        "# Per-client forecasts on ServeGen m-large (training half)\n",
        f"Machine: {machine()}; load average {load_start} at the start; command: "
        "`uv run python bench/forecaster/client_forecast.py`. Only the first 7 days (the "
        "training half) are read; the method is in the module docstring. Peers measured in "
        "the same run: the aggregate's last value and the aggregate gbm.\n",
    ]
    share = r.sum(axis=1) / r.sum()
    on = r > ON_FRAC * np.maximum(r.max(axis=1, keepdims=True), 1e-12)
    d1 = np.diff(r, axis=1)
    big = np.abs(np.diff(agg)) > BIG_MOVE * agg[:-1]
    causes = np.argmax(np.abs(d1[:, big]), axis=0)
    cause_count = np.bincount(causes, minlength=len(r))
    lines += [
        f"{len(r)} clients; the 10 largest carry {100 * np.sort(share)[::-1][:10].sum():.0f}% "
        f"of requests. The aggregate moves by more than {100 * BIG_MOVE:.0f}% from one bin to "
        f"the next in {big.sum()} of {len(big)} bins; in those, the client with the largest "
        f"move alone moves it by a median {100 * np.median(np.abs(d1[causes, np.flatnonzero(big)]) / np.abs(np.diff(agg)[big])):.0f}% "
        "of the aggregate's move.\n",
        "| client (file order) | share of requests | bins on | causes of big moves "
        "| daily on-set overlap (Jaccard) | corr(move next bin, same move yesterday) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    t = np.arange(DAY, split - 1)
    show = sorted(set(np.argsort(-share)[:8]) | set(np.argsort(-cause_count)[:4]),
                  key=lambda c: -share[c])  # fmt: skip
    for c in show:
        mv, yest = r[c, t + 1] - r[c, t], r[c, t + 1 - DAY] - r[c, t - DAY]
        corr = np.corrcoef(mv, yest)[0, 1] if mv.std() > 0 and yest.std() > 0 else float("nan")
        lines.append(
            f"| {c} | {100 * share[c]:.1f}% | {100 * on[c].mean():.0f}% | {cause_count[c]} "
            f"| {jaccard_days(on[c]):.2f} | {corr:+.2f} |"
        )
    lines += [
        "\n| horizon | forecast | WAPE (days 6-7) | WAPE on >20% moves | moves |",
        "|---|---|---|---|---|",
    ]
    spec = forecast.ForecastSpec(bin_s=600.0, horizon=2, upper_q=0.9, train_until=split)
    gbm_agg = forecast.run_model("gbm", agg, spec)
    for h in (1, 2):
        x, y, origin = features(r, agg, h)
        fit = origin < FIT_END - h
        model = HistGradientBoostingRegressor(
            max_iter=200, learning_rate=0.05, max_leaf_nodes=15, min_samples_leaf=40,
            random_state=0,
        )  # fmt: skip
        with threadpool_limits(1):
            model.fit(x[fit], y[fit])
            pred = model.predict(x)
        ts = np.unique(origin)
        score = ts >= FIT_END
        t_s = ts[score]
        actual = agg[t_s + h]
        moves = np.abs(actual / agg[t_s] - 1) > BIG_MOVE
        per_client = (pred.reshape(len(r), -1) * agg[ts][None, :]).sum(axis=0)[score]
        yest = (r[:, t_s] + r[:, t_s - DAY + h] - r[:, t_s - DAY]).clip(0).sum(axis=0)
        cands = {
            "aggregate last value (peer)": agg[t_s],
            "aggregate gbm": gbm_agg.p50[t_s, h - 1],
            "client+yesterday": yest,
            "client-gbm (sum of per-client forecasts)": np.maximum(agg[t_s] + per_client, 0),
        }
        for name, fc in cands.items():
            lines.append(
                f"| {h * 10} min | {name} | {100 * metrics.wape(actual, fc):.1f}% "
                f"| {100 * metrics.wape(actual[moves], fc[moves]):.1f}% | {moves.sum()} |"
            )
    lines.append(
        f"\nRan {time.monotonic() - started:.0f} s; load average "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + " at the end.\n"
    )
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
