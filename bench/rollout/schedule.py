"""Rollouts started at random moments against rollouts planned into the forecast's
low-demand windows, with forecast-blind and with capacity-safe canaries: SLO attainment
during the rollout, extra missed requests and extra replica-hours, on the ServeGen
aggregate trace, in the fluid simulator.

A rollout is asked for at a random moment of each of days 8 to 13 (``--per-day`` times
a day, seeded). Four ways to run it, each against the same day without a rollout:

- ``in-place@random``: started at once as a Deployment's own rolling update of the pool
  (Kubernetes' defaults, a quarter of the replicas out of service per round: what
  editing the serving Deployment in place does);
- ``blind@random``: started at once; the canary is the step's share of the pool's
  replicas now (Argo Rollouts', KServe's canaries: they do not know demand);
- ``safe@random``: started at once, with the operator's rules
  (`hybridllm_forecaster.rollouts`: the canary sized for its share of the forecast P90
  over the step, the surge up before traffic moves, no move while the pool is forecast
  past its maximum);
- ``in-place@planned``, ``blind@planned``, ``safe@planned``: started at the moment `windows.plan_start` picks
  for ``spec.rollout.window: {belowPeakPercent: 40}`` from the profile of the days before
  (the operator's planner), then as above.

The pool is the forecaster's default monolithic pool (an 8B model on one H100, 180 s
cold start), autoscaled by the operator's default policy (``hybrid``: the forecast P90
with a reactive floor, the same `policies.PredictiveWithFloor` the operator runs), in a
cluster with room for ``--room-factor`` times the trace's P99 need (every replica,
stable or canary, takes a GPU; a pod that does not fit waits). The rollout's steps are
the CRD's default (10% and 50% for 300 s each, then 100%), its promotion restarts the
stable pool at once while the canary serves all traffic.

    uv run python bench/rollout/schedule.py     # writes bench/results/rollout-schedule.{md,json}
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from hybridllm_forecaster import forecast, loaders, policies, rollouts, windows
from hybridllm_forecaster.capacity import DEFAULT_POOLS, PoolConfig
from hybridllm_forecaster.fluid import simulate_fluid, step_series
from hybridllm_forecaster.stream import DemandSeries

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from portable import TRACES
from procs import machine

ROOT = Path(__file__).resolve().parents[2]
TRACE = TRACES / "servegen-2025" / "m-large-aggregate-10min.csv"
DAY = windows.DAY_S
WARMUP_S = 2 * 3600.0  # the simulation starts this long before the rollout is asked for
AFTER_S = DAY + 6 * 3600.0  # and runs this long after (a planned start waits up to a day)
ARMS = (
    "in-place@random",
    "blind@random",
    "safe@random",
    "in-place@planned",
    "blind@planned",
    "safe@planned",
)


def _window_sim(
    demand: DemandSeries,
    pool: PoolConfig,
    upper: np.ndarray,
    lo: int,
    hi: int,
    overlay: rollouts.CanaryRollout | None,
):  # type: ignore[no-untyped-def]
    """The fluid simulator over bins [lo, hi), the pool autoscaled by the hybrid policy
    (the forecast issued over the whole trace), with ``overlay`` (times relative to bin lo)."""
    part = demand.slice(lo, hi)
    offset = -lo * demand.bin_s
    observed_after = pool.control_interval_s + policies.METRIC_DELAY_S
    fn = policies.forecast_max_fn(upper, demand.bin_s, offset, observed_after)
    policy = policies.PredictiveWithFloor(pool, fn)
    initial = pool.replicas_for(float(pool.work_series(demand)[lo]))
    return simulate_fluid(part, pool, policy, initial_replicas=initial, overlay=overlay), fn


def _need_fn(fn, pool: PoolConfig):  # type: ignore[no-untyped-def]
    def need(now_s: float, beyond_s: float) -> float | None:
        return fn(now_s, now_s + pool.lead_time_s + beyond_s) / pool.target_utilisation

    return need


def _during(result, rate: np.ndarray, dt: float, a: float, b: float) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(requests, requests within the SLO) of the steps in [a, b)."""
    k0, k1 = int(a // dt), math.ceil(b / dt)
    n = rate[k0:k1] * dt
    return float(np.sum(n)), float(np.sum(n * result.attainment[k0:k1]))


def run(per_day: int, room_factor: float, below_peak: float, seed: int) -> dict:  # type: ignore[type-arg]
    demand, _ = loaders.load_demand(TRACE)
    base = DEFAULT_POOLS["monolithic"]
    work = base.work_series(demand)
    room = math.ceil(room_factor * float(np.quantile(work, 0.99)) / base.target_utilisation)
    pool = base.with_(max_replicas=room)
    per_bin_day = int(DAY / demand.bin_s)
    horizon = max(1, math.ceil(pool.lead_time_s / demand.bin_s)) + 1
    spec = forecast.ForecastSpec(
        bin_s=demand.bin_s, horizon=horizon, train_until=7 * per_bin_day, min_train=48,
        start_epoch_s=0.0,
    )  # fmt: skip
    upper = forecast.run_model("holt-winters", work, spec).upper
    steps = rollouts.DEFAULT_STEPS
    duration = sum(p for _, p in steps) + 2 * pool.lead_time_s  # rollout.expected_duration_s
    window = windows.Window(below_peak=below_peak)
    rng = np.random.default_rng(seed)
    trials = []
    days = int(demand.num_bins / per_bin_day)
    started = time.monotonic()
    for day in range(7, days - 1):
        profile = windows.DayProfile.from_history(work[: day * per_bin_day], demand.bin_s, 0.0)
        assert profile is not None
        for asked in day * DAY + rng.uniform(0, DAY, size=per_day):
            plan = windows.plan_start(float(asked), duration, window, profile)
            lo = int((asked - WARMUP_S) // demand.bin_s)
            hi = min(demand.num_bins, int((asked + AFTER_S) // demand.bin_s) + 1)
            t0 = lo * demand.bin_s
            baseline, fn = _window_sim(demand, pool, upper, lo, hi, None)
            dt = pool.control_interval_s
            rate = step_series(demand.slice(lo, hi), dt)["req_per_s"]
            trial = {"asked_s": float(asked), "planned_s": plan.start_s, "arms": {}}
            for arm in ARMS:
                rules, when = arm.split("@")
                start = (asked if when == "random" else plan.start_s) - t0
                overlay: rollouts.CanaryRollout | rollouts.InPlaceRollout
                if rules == "in-place":
                    overlay = rollouts.InPlaceRollout(start, pool.cold_start_s, room)
                else:
                    overlay = rollouts.CanaryRollout(
                        start_s=start, cold_start_s=pool.cold_start_s, room=room,
                        need=_need_fn(fn, pool) if rules == "safe" else None, steps=steps,
                    )  # fmt: skip
                result, _ = _window_sim(demand, pool, upper, lo, hi, overlay)
                end = overlay.end_s if overlay.end_s is not None else result.duration_s
                n, ok = _during(result, rate, dt, start, end)
                _, ok_base = _during(baseline, rate, dt, start, end)
                a, b = int((start + t0) // demand.bin_s), int((end + t0) // demand.bin_s) + 1
                trial["arms"][arm] = {
                    "start_s": start + t0,
                    "finished": overlay.end_s is not None,
                    "duration_s": end - start,
                    "held_s": overlay.held_s,
                    "requests": n,
                    "attainment": ok / n if n else 1.0,
                    "attainment_without": ok_base / n if n else 1.0,
                    "extra_missed": ok_base - ok,
                    "extra_replica_hours": result.replica_hours - baseline.replica_hours,
                    "peak_demand_replicas": float(np.max(work[a:b])) / pool.target_utilisation,
                }
            trials.append(trial)
        print(f"day {day + 1}: {len(trials)} rollouts, {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    summary = {}
    for arm in ARMS:
        rows = [t["arms"][arm] for t in trials]
        summary[arm] = {
            "rollouts": len(rows),
            "finished": sum(r["finished"] for r in rows),
            "attainment_median": float(np.median([r["attainment"] for r in rows])),
            "attainment_p10": float(np.quantile([r["attainment"] for r in rows], 0.1)),
            "attainment_pooled": sum(r["attainment"] * r["requests"] for r in rows)
            / max(1.0, sum(r["requests"] for r in rows)),
            "attainment_without_pooled": sum(r["attainment_without"] * r["requests"] for r in rows)
            / max(1.0, sum(r["requests"] for r in rows)),
            "extra_missed_total": float(sum(r["extra_missed"] for r in rows)),
            "extra_missed_median": float(np.median([r["extra_missed"] for r in rows])),
            "extra_replica_hours_median": float(
                np.median([r["extra_replica_hours"] for r in rows])
            ),
            "extra_replica_hours_mean": float(np.mean([r["extra_replica_hours"] for r in rows])),
            "duration_min_median": float(np.median([r["duration_s"] for r in rows])) / 60,
            "held_min_median": float(np.median([r["held_s"] for r in rows])) / 60,
            "peak_demand_median": float(np.median([r["peak_demand_replicas"] for r in rows])),
        }
    return {
        "trace": str(TRACE.relative_to(ROOT.parent)),
        "pool": {"name": pool.name, "cold_start_s": pool.cold_start_s, "room": room,
                 "target_utilisation": pool.target_utilisation,
                 "p99_need": float(np.quantile(work, 0.99)) / pool.target_utilisation},
        "steps": [list(s) for s in steps],
        "window": {"belowPeakPercent": round(100 * below_peak)},
        "per_day": per_day,
        "seed": seed,
        "summary": summary,
        "trials": trials,
    }  # fmt: skip


def _table(out: dict) -> list[str]:  # type: ignore[type-arg]
    s, p = out["summary"], out["pool"]
    lines = [
        f"### Room for {p['room']} replicas ({p['room'] / p['p99_need']:.2f}x the P99 need)",
        "",
        "| arm | finished | attainment during the rollout (median / P10) | the same intervals without it (pooled: with / without) | extra missed requests (total) | extra replica-hours per rollout (median / mean) | duration, min (median) | held, min (median) | peak need during it, replicas (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        r = s[arm]
        lines.append(
            f"| {arm} | {r['finished']}/{r['rollouts']} | {r['attainment_median']:.2%} / "
            f"{r['attainment_p10']:.2%} | {r['attainment_pooled']:.2%} / "
            f"{r['attainment_without_pooled']:.2%} | {r['extra_missed_total']:,.0f} | "
            f"{r['extra_replica_hours_median']:.1f} / {r['extra_replica_hours_mean']:.1f} | "
            f"{r['duration_min_median']:.0f} | {r['held_min_median']:.0f} | "
            f"{r['peak_demand_median']:.0f} |"
        )
    return [*lines, ""]


def write(out: dict, path: Path, argv: list[str]) -> None:  # type: ignore[type-arg]
    path.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    first = out["runs"][0]
    p = first["pool"]
    lines = [
        "# Rollouts: random starts against forecast-planned ones, forecast-blind against capacity-safe",
        "",
        f"Command: `uv run python bench/rollout/schedule.py{''.join(' ' + a for a in argv)}`",
        "",
        f"Machine: {machine()}. Simulated (the fluid simulator): the machine does not change "
        "the numbers, only how long they take.",
        "",
        f"Trace: `{first['trace']}` (14 days of 10-minute bins); a rollout asked for at "
        f"{first['per_day']} random moments of each of days 8 to 13 (seed {first['seed']}), "
        f"{first['summary'][ARMS[0]]['rollouts']} rollouts per arm. Pool: the forecaster's "
        f"default monolithic pool (cold start {p['cold_start_s']:.0f} s, target utilisation "
        f"{p['target_utilisation']:.0%}; the trace's P99 need is {p['p99_need']:.0f} replicas), "
        "autoscaled by the `hybrid` policy, in a cluster with room for a fixed number of "
        "replicas (below). Steps "
        f"{first['steps']} (weight %, pause s); planned starts use `window: "
        f"{{belowPeakPercent: {first['window']['belowPeakPercent']}}}` on the profile of the "
        "days before.",
        "",
    ]
    for run_out in out["runs"]:
        lines += _table(run_out)
    lines += [
        "Attainment: the share of requests within the pool's TTFT and TBT objectives over the "
        "rollout's own interval (from its start to the canary's removal); *without*: the same "
        "intervals in a run of the same days with no rollout. Extra missed requests and "
        "replica-hours: the run with the rollout minus the run without (negative: the rollout's "
        "canary, beside a stable pool that keeps its replicas, served requests the autoscaler "
        "alone would have missed). Peers: `blind` is the rule of a canary that does not know "
        "demand (Argo Rollouts' `setWeight` canary without `dynamicStableScale`, KServe's "
        "`canaryTrafficPercent`): its share of the replicas now, traffic moved once it runs; "
        "every arm waits for the canary's pods and places the stable pool's scale-ups first.",
        "",
    ]
    path.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-day", type=int, default=10)
    parser.add_argument("--room-factor", type=float, nargs="+", default=[1.1, 0.8])
    parser.add_argument("--below-peak", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout-schedule")
    args = parser.parse_args(argv)
    out = {"runs": [run(args.per_day, f, args.below_peak, args.seed) for f in args.room_factor]}
    write(out, args.out, sys.argv[1:] if argv is None else argv)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
