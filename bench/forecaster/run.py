"""Forecaster benchmark: `hybridllm forecast eval` on the development traces, one summary.

Run from the repository root:

    uv run python bench/forecaster/run.py            # all cases (10-15 minutes on 2 cores)
    uv run python bench/forecaster/run.py servegen   # only cases whose name contains "servegen"
    uv run python bench/forecaster/run.py --summary ["load average ..."]  # summary only

Each case is the exact CLI command printed in the summary; its report, results.json and
plots land in bench/results/forecaster/<case>/, and bench/results/forecaster.md collects
the verdicts, the wall time of each command, and the machine. The simulations are
seeded and deterministic, so a repeated run gives the same numbers; only wall times vary
(this machine is shared: compare them with the ServeGen case's time in the same run).
The peer of the fluid simulator is the per-request simulator on the same trace
(`azure-conv` vs `azure-conv-fluid`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

from hybridllm_common import cli

ROOT = Path(__file__).resolve().parents[2]
TRACES = Path("../shared/traces")
OUT = Path("bench/results/forecaster")

CASES: dict[str, list[str]] = {
    "servegen-m-large": ["--trace", str(TRACES / "servegen-2025/m-large")],
    "servegen-m-large-cold600": [
        "--trace", str(TRACES / "servegen-2025/m-large"), "--cold-start", "600",
    ],
    "azure-code": ["--trace", str(TRACES / "azure-2023/AzureLLMInferenceTrace_code.csv")],
    "azure-code-small-replicas": [
        "--trace", str(TRACES / "azure-2023/AzureLLMInferenceTrace_code.csv"),
        "--capacity-scale", "0.25",
    ],
    "azure-code-sized": [
        "--trace", str(TRACES / "azure-2023/AzureLLMInferenceTrace_code.csv"),
        "--demand-scale", "auto",
    ],
    "azure-conv": ["--trace", str(TRACES / "azure-2023/AzureLLMInferenceTrace_conv.csv")],
    "azure-conv-fluid": [
        "--trace", str(TRACES / "azure-2023/AzureLLMInferenceTrace_conv.csv"),
        "--simulator", "fluid",
    ],
    "mooncake-conversation": [
        "--trace", str(TRACES / "mooncake-2025/conversation_trace.jsonl"),
        "--slo", "ttft=10,tbt=0.1",
    ],
    "swe-agent-sessions": ["--trace", str(TRACES / "swe-agent")],
    "swe-agent-sessions-sized": ["--trace", str(TRACES / "swe-agent"), "--demand-scale", "auto"],
}  # fmt: skip


DIAGNOSTICS = (
    ("forecast-value.md", "how good a forecast must be for +5 points (training half)"),
    ("forecast-value-test.md", "the same on the test half, after the fact (chooses nothing)"),
    ("where-lost.md", "where each policy loses SLO: at jumps or in steady bins (test half)"),
    ("client-forecast.md", "per-client regularity and per-client forecasts (training half)"),
    ("min-leaf.md", "the gbm's leaf size, chosen on the training halves"),
    ("fluid-calibration.md", "the fluid simulator against the per-request one"),
)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
        mem = f"{mem_kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError) as exc:
        print(f"could not read /proc for the machine description: {exc}", file=sys.stderr)
        mem = "RAM unknown"
    return f"{os.cpu_count()} cores, {cpu}, {mem}"


def main(argv: list[str]) -> int:
    os.chdir(ROOT)
    if argv[:1] == ["--summary"]:
        load = argv[1] if len(argv) > 1 else f"{_load()} (when the summary was written)"
        rows = []
        for name, args in CASES.items():
            if (OUT / name / "results.json").exists():
                cmd = [
                    "uv",
                    "run",
                    "hybridllm",
                    "forecast",
                    "eval",
                    *args,
                    "--out",
                    str(OUT / name),
                ]
                data = json.loads((OUT / name / "results.json").read_text())
                rows.append((name, shlex.join(cmd), data))
        write_summary(rows, load)
        return 0
    load_start = _load()
    only = argv[0] if argv else ""
    rows = []
    for name, args in CASES.items():
        if only and only not in name:
            continue
        out = OUT / name
        command = ["hybridllm", "forecast", "eval", *args, "--out", str(out)]
        print(f"== {name}: {shlex.join(command)}", flush=True)
        rc = cli.main(command[1:])
        if rc not in (0, NOT_MEANINGFUL):  # 3: written, and declared not meaningful
            print(f"{name} failed with exit code {rc}", file=sys.stderr)
            return rc
        data = json.loads((out / "results.json").read_text())
        rows.append((name, shlex.join(["uv", "run", *command]), data))
    if not only:
        write_summary(rows, f"{load_start} at the start, {_load()} at the end")
    return 0


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def write_summary(rows: list[tuple[str, str, dict]], load: str) -> None:
    lines = [
        "# Forecaster: predictive vs reactive scaling on the development traces\n",
        f"Machine: {machine()}; {load}. Produced by `uv run python bench/forecaster/run.py` "
        f"({time.strftime('%Y-%m-%d')}). Train on the first half of each trace's time, test on "
        "the second; every number below is from the test half. Per-case reports and plots: "
        "`bench/results/forecaster/<case>/report.md`.\n",
        "| case | simulator | HPA (70%) SLO / replica-h | predictive SLO / cost vs HPA "
        "(knobs) | predictive+floor SLO / cost vs HPA (knobs) | oracle SLO / cost vs HPA | "
        "SLO points at HPA's cost: predictive, +floor, oracle, hpa-tuned | "
        "cost at HPA's SLO: predictive, +floor, oracle | valid? | finding: predictive, "
        "+floor, oracle | goal met | "
        "WAPE gbm / last value: scale-up horizon (model used); horizon the policy reads; "
        "on >20% moves | eval time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, _cmd, data in rows:
        pol = {p["policy"]: p for p in data["policies"]}
        v = data["verdict"]
        hpa, pred, flo, orc = pol["hpa"], pol["predictive"], pol["predictive+floor"], pol["oracle"]
        sim = data["sweeps_test"]["hpa"][0]["simulator"]
        fc = v["forecast"]
        wall = re.search(r"ran (\d+) s", data["header"])
        at_cost = ", ".join(_pts(v[f]["slo_points_at_equal_cost"]) for f in FAMILIES)
        tuned = (
            v["predictive"]["slo_points_at_equal_cost"]
            - v["predictive"]["slo_points_at_equal_cost_vs_hpa_tuned"]
        )
        at_slo = ", ".join(_ratio(v[f]["cost_ratio_at_equal_slo"]) for f in FAMILIES)
        met = [f for f in FAMILIES if v[f]["goal_met"]]
        problems = data.get("validity", {}).get("problems", v.get("problems", []))
        valid = "yes" if not problems else "no: " + ", ".join(_label(x) for x in problems)
        cells = [
            name,
            sim,
            f"{100 * hpa['slo_attainment']:.1f}% / {hpa['replica_hours']:,.1f}",
            *(
                f"{100 * p['slo_attainment']:.1f}% / {p['cost_vs_hpa']:.2f}x ({_knobs(p)})"
                for p in (pred, flo)
            ),
            f"{100 * orc['slo_attainment']:.1f}% / {orc['cost_vs_hpa']:.2f}x",
            f"{at_cost}, {_pts(tuned)}",
            at_slo,
            valid,
            ", ".join(str(v[f].get("finding") or "-") for f in FAMILIES),
            ("-" if problems else ", ".join(met) or "no"),
            f"{_pct(fc['wape_gbm'])} / {_pct(fc['wape_last_value'])} at "
            f"{fc['horizon_min']:.3g} min ({fc['chosen_model']}); "
            f"{_pct(fc['wape_gbm_policy_horizon'])} / {_pct(fc['wape_last_policy_horizon'])} at "
            f"{fc['policy_horizon_min']:.3g} min; "
            f"{_pct(fc['wape_moves_gbm'])} / {_pct(fc['wape_moves_last'])}",
            wall.group(1) + " s" if wall else "n/a",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\nReading the table: *cost vs HPA* is replica-hours over the HPA's, for the setting "
        "chosen on the training half (the cheapest reaching the HPA's training attainment); "
        "*knobs*: the forecast quantile planned for and the scale-down window, chosen on the "
        "training half by attainment at the HPA's training cost. *hpa-tuned* is the HPA "
        "given the same scale-down window choice (0, 300 or 900 s), the reactive peer tuned "
        "over the same knob. "
        "*valid?*: the report's validity checks (docs/forecaster.md, *Validity checks*): "
        "*saturated* (a policy at the pool's maximum for over 5% of the test half), *idle "
        "pool* (every policy at the minimum for over 80%), *SLO out of reach* (no setting, "
        "fixed pool or low HPA target reaches 90%), *SLO misfits* (over half the requests miss the SLO alone on an idle "
        "replica); a void comparison has no finding and no goal. *finding*: 'better' or "
        "'worse' than the HPA beyond the noise (a paired block bootstrap of the test half, "
        "never under 2 SLO points at its cost or 3% cost at its attainment), 'mixed', or "
        "'no difference'. *_sized* cases size the trace with "
        "`--demand-scale auto` (its mean load on 8 replicas). "
        "*SLO points at HPA's cost* interpolates each family's test sweep (`frontier.png`) "
        "at the HPA's replica-hours ('outside the sweep' when no setting is that cheap); "
        "*cost at HPA's SLO* interpolates the replica-hours at which the sweep reaches the "
        "HPA's attainment. *Goal met*: at least the HPA's attainment at <= 0.8x its "
        "replica-hours, or +5 points at equal replica-hours (the oracle is listed to show "
        "what a perfect forecast would reach). Azure traces are one hour long (10-second bins, 30 minutes to "
        "train); `swe-agent-sessions` replays trajectory shapes as synthetic sessions "
        "(0.5 sessions/s over 4 h with a +-50% wave), so it exercises the pipeline rather "
        "than real arrival patterns; `azure-code-small-replicas` makes a replica 4x "
        "smaller so that the burst test needs more than one or two replicas; "
        "`azure-conv-fluid` is the fluid simulator on the same trace as `azure-conv` "
        "(the peer that checks the approximation). Simulations are seeded and "
        "deterministic; *eval time* is the CLI's own measurement on this shared machine."
    )
    lines.append("\nCommands:\n")
    lines += [f"- `{name}`: `{cmd}`" for name, cmd, _ in rows]
    lines += ["\nDiagnostics (each file names the command that wrote it):\n"]
    lines += [f"- `{OUT / f}`: {what}" for f, what in DIAGNOSTICS]
    Path("bench/results/forecaster.md").write_text("\n".join(lines) + "\n")
    print("wrote bench/results/forecaster.md")


FAMILIES = ("predictive", "predictive+floor", "oracle")
NOT_MEANINGFUL = 3  # `forecast eval`: the report is written, the comparison is void


def _label(problem: str) -> str:
    """A validity problem of a report in two or three words."""
    for needle, label in (
        ("pool's maximum", "saturated"), ("pool's minimum", "idle pool"),
        ("even the oracle", "SLO out of reach"), ("alone on an idle replica", "SLO misfits"),
        ("requests (fewer", "too few requests"), ("no requests", "no requests"),
    ):  # fmt: skip
        if needle in problem:
            return label
    return problem[:40]


def _knobs(p: dict) -> str:
    return f"{p.get('plans_for') or '?'}, {p['scale_down_window_s']:g} s"


def _pct(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def _ratio(v: float | None) -> str:
    if v is None or v != v:
        return "not reached"
    return f"{v:.2f}x"


def _pts(v: float | None) -> str:
    if v is None or v != v:
        return "outside the sweep"
    return f"{v:+.1f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
