"""The benchmark index, generated from the current results files in ``bench/results/``.

    uv run python bench/index.py           # write both tables (make bench-index)
    uv run python bench/index.py --check   # exit 1 when either is out of date (make lint)

Writes the table of ``bench/README.md`` (every experiment: its command, results files,
peer, headline numbers, goal and whether the numbers meet it) and the Performance table of
``README.md`` (one row per experiment with a peer or a goal), each between its marker
comments. Each experiment is declared once, in ``EXPERIMENTS``; its extractor reads the
numbers out of the results JSON (the Markdown where there is none), so no number in either
table is typed by hand. A results file that lacks a number an extractor needs stops the
generator with a message naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# What the "met?" column may say (a few words may follow, in brackets or after a colon).
MET, NOT_MET, NO_GOAL, WITHIN_NOISE, NOT_MEASURED = (
    "met",
    "not met",
    "no goal",
    "within noise",
    "not yet measured",
)
VERDICTS = (MET, NOT_MET, NO_GOAL, WITHIN_NOISE, NOT_MEASURED)


class Results:
    """The files of one ``bench/results/`` folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def json(self, name: str) -> Any:
        return json.loads((self.folder / name).read_text())

    def text(self, name: str) -> str:
        return (self.folder / name).read_text()


@dataclass(frozen=True)
class Headline:
    result: str  # the headline numbers, against the peer (both tables)
    met: str  # one of VERDICTS, then a few words if needed
    detail: str = ""  # more numbers, in bench/README.md only
    peer_note: str = ""  # how this file's peers actually ran, where the registry's text differs


@dataclass(frozen=True)
class Experiment:
    name: str  # bench/README.md's row
    command: str | tuple[str, ...]  # from the repository root (several: one per results file)
    results: tuple[str, ...]  # files and folders under bench/results/, the main one first
    peer: str  # the peer and its settings in a few words ("" : none)
    goal: str  # the goal and the issue that set it ("" : none)
    extract: Callable[[Results], Headline]
    short: str = ""  # README.md's row ("" : the name)
    diagnostic: bool = False  # a diagnostic: never in README.md's table
    optional: bool = False  # may be deleted: the row is left out while its main file is missing
    pending: bool = False  # being built: "not yet measured" while its main file is missing

    @property
    def in_readme(self) -> bool:
        return bool(self.peer or self.goal) and not self.diagnostic


# ---------------------------------------------------------------------------------------
# formatting


def x(v: float) -> str:
    """A ratio: two decimals, one from 10x up."""
    return f"{v:.1f}x" if v >= 10 else f"{v:.2f}x"


def x3(v: float) -> str:
    """A ratio close to 1 that two decimals would round away (perplexity)."""
    return f"{v:.3f}x"


def pct(v: float, digits: int = 1) -> str:
    return f"{100 * v:.{digits}f}%"


def verdict(goals: list[tuple[str, bool]]) -> str:
    """``met`` when every named goal holds, else ``not met (the ones that do not)``."""
    missed = [name for name, ok in goals if not ok]
    if not missed:
        return MET
    if len(goals) == 1:
        return NOT_MET
    return f"{NOT_MET} ({', '.join(missed)})"


def says_within_noise(text: str) -> bool:
    """The results file's own words: a verdict of "within noise" is the file's, never ours."""
    return "within noise" in text.lower() or "within the noise" in text.lower()


# ---------------------------------------------------------------------------------------
# extractors: one per experiment (or per layout), each from the files alone


def edge_servers(stem: str) -> Callable[[Results], Headline]:
    """bench/edge/servers.py: ours against llama-server and llama_cpp.server."""

    def extract(r: Results) -> Headline:
        d = r.json(f"{stem}.json")
        loads = d["loads"]
        single = d["single_stream"]["ours"] / d["single_stream"]["llama-server"]

        def ratio(load: str, key: str, peer: str = "llama-server") -> float:
            return float(loads[load]["ours"][key] / loads[load][peer][key])

        tps, p95 = ratio("plain:8", "tokens_per_s"), ratio("plain:8", "p95_latency_s")
        met = verdict(
            [("8 clients", tps >= 1.0), ("p95", p95 <= 1.0), ("single stream", single >= 1.0)]
        )
        if met != MET and says_within_noise(r.text(f"{stem}.md")):
            met = f"{WITHIN_NOISE} (the file's words)"
        detail = [f"16 clients {x(ratio('plain:16', 'tokens_per_s'))}"]
        if "agentic:8" in loads:
            detail.append(
                f"agentic load (8 clients, one shared system prompt) "
                f"{x(ratio('agentic:8', 'tokens_per_s'))}, p95 {x(ratio('agentic:8', 'p95_latency_s'))}"
            )
        detail.append(
            f"{x(ratio('plain:8', 'tokens_per_s', 'llama_cpp.server'))} llama_cpp.server's "
            "tok/s at 8 clients"
        )
        return Headline(
            f"{x(tps)} llama-server's tok/s at 8 clients, p95 {x(p95)}; single stream {x(single)}",
            met,
            "; ".join(detail),
        )

    return extract


def structured(r: Results) -> Headline:
    """bench/structured/run.py: constrained against free decoding, and ours against
    llama-server under the same JSON schema."""
    d = r.json("structured.json")
    c, e = d["cloud"]["cells"], d["edge"]["cells"]
    cost16 = c["16:schema"]["tokens_per_s"] / c["16:free"]["tokens_per_s"]
    cost1 = c["1:schema"]["tokens_per_s"] / c["1:free"]["tokens_per_s"]

    def edge_ratio(key: str) -> float:
        return float(e[key]["ours"]["tokens_per_s"] / e[key]["llama-server"]["tokens_per_s"])

    met = verdict([("cloud cost at batch 16", cost16 >= 0.9), ("edge vs llama-server",
                   edge_ratio("8:schema") >= 1.0)])  # fmt: skip
    ours = [run["tokens_per_s"] for run in e["8:schema"]["ours"]["runs"]]
    peer = [run["tokens_per_s"] for run in e["8:schema"]["llama-server"]["runs"]]
    if cost16 >= 0.9 and edge_ratio("8:schema") < 1.0 and max(ours) >= min(peer):
        met = f"{WITHIN_NOISE} (edge: the rounds' ranges overlap)"
    return Headline(
        f"cloud engine under a JSON schema {x(cost16)} the free tok/s at batch 16 ({x(cost1)} at "
        f"batch 1); edge runtime under the schema {x(edge_ratio('8:schema'))} llama-server's "
        f"tok/s at 8 clients ({x(edge_ratio('1:schema'))} at 1)",
        met,
        f"free: {x(edge_ratio('8:free'))} llama-server's tok/s at 8 clients",
    )


def edge_python_server(r: Results) -> Headline:
    """bench/edge/run.py: ours against llama_cpp.server and in-process llama-cpp-python."""
    d = r.json("edge.json")
    single = d["single_stream"]["ratio_median"]
    eight = next(c for c in d["concurrency"] if c["clients"] == 8)
    hit = d["cache"]["openai_create"]["median_ms"]
    met = verdict(
        [
            ("8 clients", eight["throughput_ratio"] >= 2.0),
            ("single stream", single >= 0.95),
            ("cache hit", hit < 5.0),
        ]
    )
    detail = ""
    if r.exists("edge-servers.json"):
        here = statistics.median(d["single_stream"]["in_process_decode_tps"])
        there = r.json("edge-servers.json")["in_process"]["streamed_decode_tps"]
        detail = (
            f"this run's in-process baseline ({here:.1f} tok/s) did not reproduce: "
            f"{there:.1f} in edge-servers.json"
        )
    return Headline(
        f"8 clients {x(eight['throughput_ratio'])} llama_cpp.server's tok/s (p95 "
        f"{x(eight['p95_ratio'])}); single stream {x(single)} in-process; cache hit "
        f"{hit:.2f} ms median (openai client)",
        met,
        detail,
    )


def edge_scaling(r: Results) -> Headline:
    d = r.json("edge-scaling.json")
    gains = ", ".join(f"{w} {x(cells['8']['gain_vs_batch1'])}" for w, cells in d["results"].items())
    return Headline(f"tok/s at batch 8 over batch 1: {gains}", NO_GOAL,
                    "the most an 8-client throughput ratio can reach with these kernels")  # fmt: skip


def edge_order(r: Results) -> Headline:
    d = r.json("edge-order.json")["over_slot_order"]
    parts = [
        f"{w.upper()} {x(o['3,0,5,1,2,4,6,7'])} (three micro-batches) to {x(o['reversed'])} (reversed)"
        for w, o in d.items()
    ]
    return Headline(
        "one decode step of 8 sequences out of slot order, against slot order: " + "; ".join(parts),
        NO_GOAL,
    )


def cloud_floor(r: Results) -> Headline:
    rows = {row["batch"]: row for row in r.json("cloud-floor.json")["rows"]}
    b32 = rows[32]
    others = [
        f"batch {b}: {x(row['ours_over_floor'])} (HF {x(row['hf_over_floor'])})"
        for b, row in sorted(rows.items())
        if b != 32
    ]
    return Headline(
        f"batch 32: our decode step {x(b32['ours_over_floor'])} the fp32 matmul floor, HF's "
        f"{x(b32['hf_over_floor'])}",
        verdict([("batch 32", b32["ours_over_floor"] <= 1.2)]),
        "; ".join(others) + f"; our step {x(b32['hf_over_ours'])} faster than HF's at batch 32",
    )


def _sweep(r: Results, stem: str, fixed: bool, n: int) -> dict[str, Any] | None:
    rows = r.json(f"{stem}.json")["sweep"]
    for row in rows:
        if (row["variant"] == "fixed") == fixed and row["concurrency"] == n:
            return dict(row)
    return None


def cloud_hf(r: Results) -> Headline:
    """bench/cloud/run.py, three runs: the main one, fixed lengths at 32, mixed lengths at 32."""
    mixed = _sweep(r, "cloud", False, 32)
    fixed = _sweep(r, "cloud", True, 32)
    if mixed is None or fixed is None:
        raise KeyError("cloud.json: the sweep has no fixed and mixed rows at 32 concurrent")
    mixed_runs = [mixed] + [s for s in [_sweep(r, "cloud-mixed32", False, 32)] if s]
    fixed_runs = [fixed] + [s for s in [_sweep(r, "cloud-out128", True, 32)] if s]
    again_mixed = ", ".join(x(s["ratio_vs_hf"]) for s in mixed_runs[1:])
    again_fixed = ", ".join(x(s["ratio_vs_hf"]) for s in fixed_runs[1:])
    mixed_ok = all(s["ratio_vs_hf"] >= 3.0 for s in mixed_runs)
    fixed_ok = all(s["ratio_vs_hf"] >= 3.0 for s in fixed_runs)
    if mixed_ok and fixed_ok:
        met = MET
    elif mixed_ok:
        met = f"{NOT_MET} at fixed lengths; {MET} on mixed lengths"
    else:
        met = NOT_MET
    prefix = r.json("cloud.json").get("prefix")
    detail = (
        f"mixed, 32: p95 TTFT {mixed['ours']['p95_ttft_s']:.1f} s against HF's "
        f"{mixed['hf_static']['p95_ttft_s']:.1f} s"
    )
    if prefix:
        detail += (
            f"; prefix caching on a shared {prefix['system_prompt_tokens']}-token prompt: "
            f"{x(prefix['ttft_speedup'])} lower median TTFT, {x(prefix['throughput_ratio'])} tok/s"
        )
    return Headline(
        f"32 concurrent: {x(mixed['ratio_vs_hf'])} HF static batching's tok/s on mixed lengths"
        + (f" ({again_mixed} in a second run)" if again_mixed else "")
        + f", {x(fixed['ratio_vs_hf'])} at fixed lengths"
        + (f" ({again_fixed} again)" if again_fixed else ""),
        met,
        detail,
    )


def disagg(stem: str) -> Callable[[Results], Headline]:
    """bench/disagg/run.py: disaggregated against the best monolithic variant in the file
    (``monolithic``, ``monolithic-1t``, ``monolithic-1t-b128``, ...) by interactive TBT p99."""

    def extract(r: Results) -> Headline:
        d = r.json(f"{stem}.json")
        med = d["medians"]
        mono = [n for n in med if n.startswith("monolithic")]
        best = min(mono, key=lambda n: med[n]["short_tbt_p99_ms"])
        dis, top = med["disaggregated"], med[best]
        tbt = dis["short_tbt_p99_ms"] / top["short_tbt_p99_ms"]
        detail = [
            f"interactive TTFT p99 {x(dis['short_ttft_p99_ms'] / top['short_ttft_p99_ms'])}",
            f"long-prompt TTFT p50 {x(dis['long_ttft_p50_s'] / top['long_ttft_p50_s'])}",
            f"output tok/s {x(dis['output_tok_s'] / top['output_tok_s'])}",
        ]
        if "two-replicas" in med:
            two = med["two-replicas"]
            detail.append(
                f"against two single-core replicas: TBT p99 "
                f"{x(dis['short_tbt_p99_ms'] / two['short_tbt_p99_ms'])} "
                f"({dis['short_tbt_p99_ms']:.0f} vs {two['short_tbt_p99_ms']:.0f} ms)"
            )
        note = (
            "this file: " + ", ".join(f"`{n}`" for n in mono)
            if "deployments" in d
            else "this file: only `monolithic`, 2 torch threads and the default step budget"
        )
        return Headline(
            f"interactive TBT p99 {x(tbt)} the best monolithic setup's (`{best}`: "
            f"{dis['short_tbt_p99_ms']:.0f} vs {top['short_tbt_p99_ms']:.0f} ms); interactive "
            f"TTFT p99 {x(dis['short_ttft_p99_ms'] / top['short_ttft_p99_ms'])}",
            verdict([("TBT p99", tbt <= 0.5)]),
            "; ".join(detail),
            note,
        )

    return extract


GATEWAY_P99_GOAL_S = 0.002  # issue #6: p99 added TTFT <= 2 ms at 256 concurrent streams
GATEWAY_LITELLM_GOAL = 3.0  # issue #6: throughput >= 3x LiteLLM's


def _litellm_ratios(summary: dict[str, Any]) -> list[tuple[int, float | None]]:
    """Gateway / LiteLLM req/s at each level above 1 (None: LiteLLM completed nothing)."""
    out: list[tuple[int, float | None]] = []
    for c, row in sorted(summary.items(), key=lambda kv: int(kv[0])):
        if int(c) <= 1 or "litellm" not in row:
            continue
        out.append((int(c), row["gateway"].get("rps_vs_litellm")))
    return out


def _gateway_peers(d: dict[str, Any]) -> str:
    """How LiteLLM and Go's proxy ran in this file, from the file."""
    targets = d["args"]["targets"]
    parts = []
    if "litellm" in targets:
        line = next((p for p in d.get("peers", []) if p.startswith("- litellm")), "")
        version = re.search(r"LiteLLM's proxy (\S+)", line)
        workers = d["args"].get("litellm_workers", d["args"]["workers"])
        parts.append(
            f"LiteLLM{' ' + version.group(1) if version else ''}, {workers} worker"
            + ("s" if workers != 1 else "")
            + (", its documented performance settings" if line else ", its default settings")
        )
    parts.append("Go's proxy " + ("in the run" if "go-http" in targets else "not in this run"))
    return "this file: " + "; ".join(parts)


def gateway(stem: str, stream: bool) -> Callable[[Results], Headline]:
    """bench/gateway/run.py, streaming (gateway.json) or not (gateway-nonstream.json)."""

    def extract(r: Results) -> Headline:
        d = r.json(f"{stem}.json")
        s = d["summary"]
        g = s["256"]["gateway"]
        ratios = _litellm_ratios(s)
        unit = "streams" if stream else "in flight"
        thr = ", ".join(
            f"{'LiteLLM completed none' if v is None else x(v)} at {c:,}"
            + (f" {unit}" if i == 0 else "")
            for i, (c, v) in enumerate(ratios)
        )
        # Judged at the most load, where each proxy runs at its maximum: below it the backend
        # paces the gateway (it serves what direct serves), which caps the ratio.
        top, most = ratios[-1]
        thr_ok = most is None or most >= GATEWAY_LITELLM_GOAL
        detail = [
            f"below 3x at {c:,} ({x(v)}), where the gateway served "
            f"{x(s[str(c)]['gateway']['rps_vs_direct'])} direct's req/s"
            for c, v in ratios[:-1]
            if v is not None and v < GATEWAY_LITELLM_GOAL
        ]
        for name, what in (("go-http", "Go's httputil.ReverseProxy"), ("nullproxy", "a bare TCP relay")):  # fmt: skip
            peer = s["256"].get(name)
            key = "added_ttft_p99" if stream else "added_e2e_p99"
            if peer is not None and peer.get(key) is not None:
                detail.append(f"{what} added {1000 * peer[key]:.2f} ms at p99")
        if g.get("proxy_cpu_ms_per_req"):
            detail.append(f"gateway CPU {g['proxy_cpu_ms_per_req']:.2f} ms per request at 256")
        if stream:
            per = [v for v in g["added_ttft_p99_repeats"] if v is not None]
            within = sum(1 for v in per if v <= GATEWAY_P99_GOAL_S)
            p99 = g["added_ttft_p99"]
            result = (
                f"p99 added TTFT at 256 streams {1000 * p99:.2f} ms ({within} of {len(per)} "
                f"repeats <= 2 ms); throughput over LiteLLM's {thr}"
            )
            met = verdict([("p99", p99 <= GATEWAY_P99_GOAL_S), (f"throughput at {top:,}", thr_ok)])
        else:
            p99 = g["added_e2e_p99"]
            result = (
                f"p99 added end to end at 256 requests in flight {1000 * p99:.2f} ms; "
                f"throughput over LiteLLM's {thr}"
            )
            met = verdict([(f"throughput at {top:,}", thr_ok)])
        return Headline(result, met, "; ".join(detail), _gateway_peers(d))

    return extract


def gateway_workers2(r: Results) -> Headline:
    s = r.json("gateway-workers2.json")["summary"]["256"]
    return Headline(
        f"{r.json('gateway-workers2.json')['args']['workers']} gateway processes: p99 added TTFT "
        f"{1000 * s['gateway']['added_ttft_p99']:.2f} ms at 256 streams; a bare TCP relay in the "
        f"same run {1000 * s['nullproxy']['added_ttft_p99']:.2f} ms",
        NO_GOAL,
    )


def gateway_diagnostics(r: Results) -> Headline:
    """The Markdown only (no JSON): its GC table, per-chunk cost and wake-up table."""
    text = r.text("gateway-diagnostics.md")

    def find(pattern: str) -> re.Match[str]:
        m = re.search(pattern, text)
        if m is None:
            raise KeyError(f"gateway-diagnostics.md: no match for {pattern!r}")
        return m

    gc = find(r"\| frozen at start-up \(shipped\) \| [^|]+ \| [^|]+ \| [^|]+ \| ([\d.]+) \|")
    chunk = find(r"\*\*([\d.]+) µs\*\* per chunk")
    wake = find(r"\| none \(the benchmark's own only\) \| (\d+) \| (\d+) \|")
    return Headline(
        f"longest GC pause at 256 streams {gc.group(1)} ms; Python work per relayed chunk "
        f"{chunk.group(1)} µs; cross-CPU wake-up p50 / p99 {wake.group(1)} / {wake.group(2)} µs",
        NO_GOAL,
    )


def kernels(r: Results) -> Headline:
    rows = r.json("kernels-cpu.json")["rows"]
    refs = [
        row["vs_peer"]
        for row in rows
        if row["kernel"] == "paged_decode_attention" and row["impl"] == "torch_ref"
    ]
    gpu = [
        row["frac_peak"]
        for row in rows
        if row["kernel"] == "paged_decode_attention"
        and row["impl"].startswith("triton")
        and row.get("frac_peak") is not None
        and row["params"]["context"] >= 4096
        and row["params"]["batch"] >= 32
    ]
    met = verdict([("HBM bandwidth", min(gpu) >= 0.8)]) if gpu else f"{NOT_MEASURED} (needs a GPU)"
    result = (
        f"paged decode attention at context >= 4k, batch >= 32: {pct(min(gpu), 0)} of peak HBM "
        "bandwidth"
        if gpu
        else "CPU only, Triton kernels not timed; the torch reference paged decode attention "
        f"takes {min(refs):.1f}-{max(refs):.1f}x SDPA's time"
    )
    return Headline(result, met)


def models(r: Results) -> Headline:
    rows = {row["format"]: row for row in r.json("models.json")["rows"]}
    peer = rows["torch fp32"]
    picks = [("GGUF Q4_1 (shipped)", "Q4_1 (shipped)"), ("GGUF Q4_K_M", "Q4_K_M"),
             ("ONNX int8", "ONNX int8")]  # fmt: skip

    def ppl(name: str) -> float:
        return float(rows[name]["perplexity"] / peer["perplexity"])

    def speed(name: str) -> float:
        return float(rows[name]["tokens_per_s"] / peer["tokens_per_s"])

    return Headline(
        "perplexity / tok/s against torch fp32: "
        + ", ".join(f"{label} {x3(ppl(n))} / {x(speed(n))}" for n, label in picks),
        NO_GOAL,
        "greedy prefix agreement with fp32: "
        + ", ".join(f"{label} {pct(rows[n]['greedy_prefix_agreement'])}" for n, label in picks),
    )


def int8_options(r: Results) -> Headline:
    d = r.json("models-int8-options.json")
    rows = d["rows"]
    peer = next(row for row in rows if row["option"] == d["meta"]["peer"])
    near = [row for row in rows if row is not peer and row["perplexity"] <= 1.02 * peer["perplexity"]]  # fmt: skip
    best = max(near, key=lambda row: row["tokens_per_s"])
    old = next((row for row in rows if "old recipe" in row.get("how", "")), None)
    return Headline(
        f"fastest recipe within 2% of fp32's perplexity: {best['option']}, "
        f"{x(best['tokens_per_s'] / peer['tokens_per_s'])} fp32's tok/s at "
        f"{x3(best['perplexity'] / peer['perplexity'])} its perplexity",
        NO_GOAL,
        (
            f"the old recipe ({old['option']}): perplexity {old['perplexity'] / peer['perplexity']:,.0f}x"
            if old
            else ""
        ),
    )


def forecaster(r: Results) -> Headline:
    cases = {p.parent.name: json.loads(p.read_text())
             for p in sorted((r.folder / "forecaster").glob("*/results.json"))}  # fmt: skip
    if "servegen-m-large" not in cases:
        raise KeyError("forecaster/servegen-m-large/results.json is missing")
    valid = {name: c for name, c in cases.items() if c["validity"]["meaningful"]}
    met_cases = [
        name
        for name, c in valid.items()
        if any(c["verdict"][p].get("goal_met") for p in ("predictive", "predictive+floor"))
    ]
    oracle = [name for name, c in valid.items() if c["verdict"]["oracle"].get("goal_met")]
    v = cases["servegen-m-large"]["verdict"]
    pred = v["predictive"]
    return Headline(
        f"ServeGen, test half: predictive {pred['slo_points_at_equal_cost']:+.1f} SLO points at "
        f"the HPA's cost, {x(pred['cost_ratio_at_equal_slo'])} its cost at its attainment "
        f"({pred['finding']} beyond the noise); goal met on {len(met_cases)} of {len(valid)} valid "
        "cases",
        MET if met_cases else NOT_MET,
        f"the oracle (a perfect forecast) {v['oracle']['slo_points_at_equal_cost']:+.1f} points "
        f"on ServeGen, meets the goal on {len(oracle)} of {len(valid)}; "
        f"{len(cases) - len(valid)} of {len(cases)} cases void (their validity checks)",
    )


def _signed(s: float | None) -> str:
    return "-" if s is None else f"{s:+.0f} s"


def autoscaling_step(r: Results) -> Headline:
    d = r.json("autoscaling-replay-step.json")
    m = d["measured"]
    rise = d["rises"][-1]
    day = len(d["rises"])
    return Headline(
        f"day {day}: SLO attainment hybrid {pct(m['hybrid']['slo_attainment'], 2)} against "
        f"reactive's {pct(m['reactive']['slo_attainment'], 2)}, at "
        f"{x(m['hybrid']['replica_seconds'] / m['reactive']['replica_seconds'])} its replica-seconds",
        NO_GOAL,
        f"the peak's replicas ready at {_signed(rise['hybrid']['peak_carried_at_s'])} (hybrid) and "
        f"{_signed(rise['reactive']['peak_carried_at_s'])} (reactive) from the rise",
    )


def autoscaling_servegen(r: Results) -> Headline:
    d = r.json("autoscaling-replay.json")
    m = d["measured"]
    base = m["reactive"]["replica_seconds"]
    cells = [
        f"{mode} {pct(m[mode]['slo_attainment'])}"
        + ("" if mode == "reactive" else f" ({x(m[mode]['replica_seconds'] / base)})")
        for mode in d["modes"]
    ]
    return Headline(
        "measured day, SLO attainment (replica-seconds against reactive): " + ", ".join(cells),
        NO_GOAL,
    )


def autoscaling_capacity(r: Results) -> Headline:
    d = r.json("autoscaling-capacity.json")
    c, m = d["capacity"], d["measured"]
    prof = c["profile"]
    cells, goals = [], []
    for label, row in c["services"].items():
        got, twin = row["learned"], label.removesuffix("+auto")
        if got is None:
            cells.append(f"{label}: not learned")
            goals.append((f"{label} learned", False))
            continue
        pre, dec = got["prefill"] / prof["prefill"], got["decode"] / prof["decode"]
        a, b = m[label], m[twin]
        band = 1.96 * math.sqrt(
            a["slo_attainment"] * (1 - a["slo_attainment"]) / max(a["requests"], 1)
            + b["slo_attainment"] * (1 - b["slo_attainment"]) / max(b["requests"], 1)
        )
        cells.append(
            f"{label}: learned prefill {x(pre)} and decode {x(dec)} of `hybridllm profile`'s; "
            f"SLO attainment {pct(a['slo_attainment'])} (typed twin {pct(b['slo_attainment'])}), "
            f"replica-seconds {x(a['replica_seconds'] / b['replica_seconds'])} the twin's"
        )
        goals += [
            ("learned within 15%", abs(pre - 1) <= 0.15 and abs(dec - 1) <= 0.15),
            ("SLO within the band",
             abs(a["slo_attainment"] - b["slo_attainment"]) <= max(band, 0.005)),
        ]  # fmt: skip
    return Headline("; ".join(cells), verdict(goals))


def autoscaling_operator(r: Results) -> Headline:
    d = r.json("autoscaling-operator.json")
    rise, day = d["rises"][-1], d["days"][-1]
    hybrid, reactive = rise["hybrid"]["set_s"], rise["reactive"]["set_s"]
    met = verdict([("before / after the rise", hybrid is not None and reactive is not None
                    and hybrid < 0 < reactive)])  # fmt: skip
    return Headline(
        f"day {len(d['rises'])}: the operator set the peak's replicas at {_signed(hybrid)} "
        f"(hybrid) and {_signed(reactive)} (reactive) from the rise",
        met,
        f"hybrid's replica-seconds {x(day['hybrid']['replica_seconds'] / day['reactive']['replica_seconds'])} "
        f"reactive's that day; operator CPU {pct(d['operator_cpu_share'])} of a core",
    )


ROLLOUT_AA_GOAL = 0.05  # the file's Target: A/A rollouts abort at most 5% of the time


def rollout_analysis(r: Results) -> Headline:
    rows = r.json("rollout-analysis.json")["rows"]
    aa = max(row["abort_rate"] for row in rows if row["case"].startswith("A/A"))

    def span(case: str) -> str:
        rates = [row["abort_rate"] for row in rows if row["case"] == case]
        return f"{pct(min(rates))}-{pct(max(rates))}"

    return Headline(
        f"worst A/A (false) abort rate {pct(aa)}; a canary 25% slower aborted in "
        f"{span('canary 25% slower')} of rollouts",
        verdict([("A/A", aa <= ROLLOUT_AA_GOAL)]),
        f"one failing 5% of attempts in {span('canary failing 5% of attempts')}",
    )


def rollout_schedule(r: Results) -> Headline:
    run = r.json("rollout-schedule.json")["runs"][0]
    s = run["summary"]
    room = run["pool"]["room"] / run["pool"]["p99_need"]
    return Headline(
        f"room {x(room)} the P99 need, random starts: attainment during the rollout "
        f"{pct(s['safe@random']['attainment_median'], 2)} (capacity-safe canary) against "
        f"{pct(s['in-place@random']['attainment_median'], 2)} (in-place update)",
        NO_GOAL,
        f"forecast-planned starts: a capacity-safe canary's extra replica-hours "
        f"{x(s['safe@planned']['extra_replica_hours_mean'] / s['safe@random']['extra_replica_hours_mean'])} "
        f"random starts' (mean), "
        f"{x(s['safe@planned']['extra_replica_hours_median'] / s['safe@random']['extra_replica_hours_median'])} "
        "(median); the forecast-blind canary "
        f"{pct(s['blind@random']['attainment_median'], 2)}",
    )


def fleet(r: Results) -> Headline:
    rows = r.json("fleet.json")["rows"]
    top = max(row["devices"] for row in rows)
    one = next(row for row in rows if row["devices"] == top and row["replicas"] == 1)
    two = next((row for row in rows if row["devices"] == top and row["replicas"] == 2), None)
    return Headline(
        f"{top:,} devices, one replica: {one['server_cpu_cores_per_1000']:.3f} cores and "
        f"{one['server_rss_mb_per_1000']:.0f} MB per 1,000 devices; a config reaches 99% of them "
        f"in {one['config_reached']['p99']:.1f} s",
        NO_GOAL,
        (
            f"two replicas: {two['server_cpu_cores_per_1000']:.3f} cores and "
            f"{two['server_rss_mb_per_1000']:.0f} MB per 1,000, 99% in {two['config_reached']['p99']:.1f} s"
            if two
            else ""
        ),
    )


OPERATOR_WRITES = ("PATCH", "APPLY", "DELETE")  # bench/operator/scale.py: the operator's verbs


def cli_start(r: Results) -> Headline:
    d = r.json("cli-start.json")
    rows = {row["command"]: row["median_s"] for row in d["rows"]}
    slowest = d["slowest"]
    peers = [f"{k} {v:.2f} s" for k, v in rows.items() if k.startswith(("kubectl", "helm"))]
    result = (
        f"`hybridllm --help` {rows['hybridllm --help']:.2f} s, `status` "
        f"{rows['hybridllm status']:.2f} s; slowest `{slowest['command']}` "
        f"{slowest['median_s']:.2f} s" + (f" ({', '.join(peers)})" if peers else "")
    )
    met = MET if d["all_under_goal"] else NOT_MET
    floor = rows.get("python -c 'import pydantic'")
    detail = f"the interpreter with pydantic alone: {floor:.2f} s" if floor else ""
    return Headline(result, met, detail)


def operator_scale(r: Results) -> Headline:
    rows = r.json("operator-scale.json")["rows"]
    top = max(row["operator"]["services"] for row in rows)
    judged = []  # (demand source, baseline, operator, operator writes/s, verdict)
    for row in rows:
        b, o = row["baseline"], row["operator"]
        if o["services"] != top:
            continue
        writes = sum(o["steady_api_requests_per_s"].get(v, 0) for v in OPERATOR_WRITES)
        met = verdict(
            [
                ("Ready within 2x", o["all_ready_s"] <= 2 * b["all_available_s"]),
                ("under 300 MB", o["operator_peak_rss_mb"] < 300),
                ("zero steady writes", writes == 0),
                ("CPU at rest", o["steady_operator_cpu_share"] < 0.05),
            ]
        )
        judged.append((o.get("demand", "scrape"), b, o, writes, met))

    def span(values: list[str]) -> str:
        return values[0] if len(set(values)) == 1 else " / ".join(values)

    sources = " / ".join(demand for demand, *_ in judged)
    result = (
        f"{top:,} services (demand from {sources}): Ready in "
        + span([x(o["all_ready_s"] / b["all_available_s"]) for _, b, o, _, _ in judged])
        + " kubectl's time, "
        + span([f"{o['operator_peak_rss_mb']:.0f}" for _, _, o, _, _ in judged])
        + " MB, "
        + span([f"{w:g}" for _, _, _, w, _ in judged])
        + " steady writes/s, "
        + span([pct(o["steady_operator_cpu_share"]) for _, _, o, _, _ in judged])
        + " of a core at rest"
    )
    if all(met == MET for *_, met in judged):
        overall = MET
    else:
        overall = "; ".join(
            f"{met} with demand from {demand}"
            for demand, *_, met in sorted(judged, key=lambda j: j[-1] == MET)
        )
    return Headline(result, overall)


def hybrid(r: Results) -> Headline:
    """bench/hybrid/run.py on the SWE-agent sessions."""
    return hybrid_run(r, "hybrid.json")


def hybrid_mooncake(r: Results) -> Headline:
    """bench/hybrid/run.py on the Mooncake conversations."""
    return hybrid_run(r, "hybrid-mooncake.json")


def hybrid_workflows_gateway(r: Results) -> Headline:
    """bench/hybrid/run.py --workload workflows: the workflow shapes through the gateway."""
    return hybrid_run(r, "hybrid-workflows-gateway.json")


def hybrid_run(r: Results, name: str) -> Headline:
    """bench/hybrid/run.py: the three architectures (and variants) on the same sessions;
    cost is the two cores held for the run (what a deployment pays for); medians where
    the file holds several runs."""
    d = r.json(name)
    runs = int(d["params"].get("repeats", 1))
    COST = "provisioned_cost_per_million_tokens"
    res = d["architectures"]

    def cell(name: str) -> str:
        a = res[name]
        edge = f", {pct(a['edge_share'], 0)} on the edge" if a.get("edge_share") else ""
        return (f"`{name}` {a['session_model_time_p95_s']:.1f} s, "
                f"${a[COST]:.2f}/M{edge}")  # fmt: skip

    result = "P95 session model time and cost per million tokens (two cores held): " + "; ".join(
        cell(n) for n in res
    )
    goals = []
    if {"monolithic", "disaggregated", "hybrid"} <= set(res):
        m, di, h = (res[n] for n in ("monolithic", "disaggregated", "hybrid"))
        key = "session_model_time_p95_s"
        goals = [
            ("hybrid fastest", h[key] < min(m[key], di[key])),
            ("disaggregated faster than monolithic", di[key] < m[key]),
            ("hybrid cheapest", h[COST] < min(m[COST], di[COST])),
        ]  # fmt: skip
    detail = f"medians of {runs} runs of each architecture" if runs > 1 else "one run"
    return Headline(result, verdict(goals) if goals else NOT_MEASURED, detail)


def search_beams(r: Results) -> Headline:
    """bench/search/run.py: beams sharing KV against copy-per-beam and HF's beam search."""
    d = r.json("search-beams.json")
    parts, detail, identical = [], [], True
    for w in d["widths"]:
        rows = w["per_prompt"]
        blocks = statistics.median(
            p["shared"]["peak_blocks"] / p["copy"]["peak_blocks"] for p in rows
        )
        speed = statistics.median(p["shared"]["beam_tok_s"] / p["hf"]["beam_tok_s"] for p in rows)
        parts.append(
            f"width {w['width']}: {x(blocks)} copy-per-beam's KV blocks, {x(speed)} HF's beam tok/s"
        )
        identical &= all(p["identical_outputs"] for p in rows)
    detail.append("outputs identical to HF's on every search" if identical
                  else "outputs differ from HF's on some search")  # fmt: skip
    return Headline("; ".join(parts), NO_GOAL, "; ".join(detail))


def search_verifier(r: Results) -> Headline:
    """bench/search/verifier.py: the step search against sampling at equal compute."""
    d = r.json("search-verifier.json")
    runs = d["runs"]
    parts = []
    for name in runs[0]["configs"]:

        def acc(c: str, name: str = name) -> float:
            return statistics.median(run["configs"][name]["accuracy"][c] for run in runs)

        tokens = statistics.median(
            run["configs"][name]["search_tokens_per_problem"] for run in runs
        )
        parts.append(f"{name} ({tokens:.0f} tokens/problem): search {pct(acc('step search'), 0)}, "
                     f"majority vote {pct(acc('majority vote'), 0)}, best-of-N "
                     f"{pct(acc('best-of-N, verifier'), 0)}")  # fmt: skip
    detail = (f"{d['settings']['problems']} problems x {len(runs)} seeds; greedy "
              f"{pct(d['greedy']['accuracy'], 0)}")  # fmt: skip
    return Headline("accuracy at equal compute, medians over seeds: " + "; ".join(parts),
                    NO_GOAL, detail)  # fmt: skip


def hybrid_workflows(r: Results) -> Headline:
    """bench/hybrid/workflows.py: batch size and output cap against CPU per token."""
    d = r.json("hybrid-workflows.json")
    return Headline("; ".join(f.removeprefix("- ") for f in d["findings"]), NO_GOAL,
                    "energy as CPU-seconds per output token (no RAPL here)")  # fmt: skip


def hybrid_projection(r: Results) -> Headline:
    """bench/hybrid/project.py: replicas and cost at the published scale."""
    d = r.json("hybrid-projection.json")
    parts, goals = [], []
    for key, p in d["projections"].items():
        c = p["cost_per_million"]
        parts.append(f"{key}: " + ", ".join(f"{a} ${c[a]:.2f}/M" for a in c))
        goals.append(
            (f"hybrid cheapest ({key})", c["hybrid"] < min(c["monolithic"], c["disaggregated"]))
        )
    return Headline("; ".join(parts), verdict(goals),
                    "GPU rows assume an 8B-on-H100 replica (not measured here)")  # fmt: skip


def hybrid_crosscheck(r: Results) -> Headline:
    """bench/hybrid/crosscheck.py: our replay against guidellm on one load."""
    d = r.json("hybrid-crosscheck.json")
    g, o, before = d["guidellm"], d["ours"], d["ours_before"]
    result = (f"ours / guidellm: requests/s {x(o['requests_per_s'] / g['requests_per_s'])}, "
              f"latency p50 {x(o['latency_p50_s'] / g['latency_p50_s'])}, TTFT p50 "
              f"{x(o['ttft_p50_s'] / g['ttft_p50_s'])}; load generator CPU "
              f"{g['client_cpu_s']:.0f} s (guidellm) against {o['client_cpu_s']:.1f} s (ours)")  # fmt: skip
    detail = (f"our run before guidellm: {before['requests_per_s']:.2f} req/s, after: "
              f"{o['requests_per_s']:.2f}")  # fmt: skip
    return Headline(result, NO_GOAL, detail)


def speculative(r: Results) -> Headline:
    """bench/speculative/run.py: n-gram speculation against none and HF prompt lookup."""
    d = r.json("speculative.json")
    parts, detail, exact = [], [], True
    for kind, k in d["kinds"].items():
        ng = k["rows"]["ours-ngram"]
        parts.append(f"{kind} prompts {x(ng['vs_ours_tok_s'])} tok/s over no speculation "
                     f"({pct(ng['acceptance_rate'], 0)} accepted), "
                     f"{x(ng['vs_hf-prompt-lookup_tok_s'])} HF prompt lookup's")  # fmt: skip
        draft = k["rows"].get("ours-draft")
        if draft:
            detail.append(f"{kind}: truncated-layer draft {x(draft['vs_ours_tok_s'])} "
                          f"({pct(draft['acceptance_rate'], 0)} accepted)")  # fmt: skip
        n = len(k["prompts"])
        exact &= all(v == n for v in k["greedy_identical_to_ours"].values())
    detail.append("greedy output identical to no speculation on every prompt" if exact
                  else "greedy output differs from no speculation on some prompt")  # fmt: skip
    return Headline("; ".join(parts), NO_GOAL, "; ".join(detail))


# ---------------------------------------------------------------------------------------
# the registry: each experiment once

LLAMA_SERVER = (
    "llama.cpp's `llama-server` (the same llama.cpp commit and build flags, `-np 8 -cb`, "
    "prompt cache, same threads); `llama_cpp.server` (defaults)"
)
EDGE_SERVERS_GOAL = (
    ">= 1.0x llama-server's tok/s at 8 clients with p95 no worse, and >= 1.0x single "
    "stream, on both files (#23)"
)

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment(
        "edge runtime vs llama.cpp's own `llama-server` and `llama_cpp.server`, Q4_1 (the "
        "shipped file): single stream, 1/4/8/16 clients, an agentic load with a shared system prompt",
        "uv run python bench/edge/servers.py",
        ("edge-servers.md",),
        LLAMA_SERVER,
        EDGE_SERVERS_GOAL,
        edge_servers("edge-servers"),
        short="edge runtime vs `llama-server`, Q4_1 (shipped)",
    ),
    Experiment(
        "the same on Q4_K_M (the LLMService default)",
        "uv run python bench/edge/servers.py --weights q4_k_m",
        ("edge-servers-q4_k_m.md",),
        LLAMA_SERVER,
        EDGE_SERVERS_GOAL,
        edge_servers("edge-servers-q4_k_m"),
        short="edge runtime vs `llama-server`, Q4_K_M (default)",
    ),
    Experiment(
        "structured output: a JSON schema's cost on the cloud engine (batch 1, 16) and the "
        "edge runtime against llama-server under the same schema (1, 8 clients)",
        "uv run python bench/structured/run.py",
        ("structured.md",),
        "the same requests without a schema, as long as the schema's answers; `llama-server` "
        "(-np 8 -cb, its json_schema grammar), same GGUF and threads",
        "constrained >= 0.9x unconstrained tok/s at batch 16 on our engine; edge >= 1.0x "
        "llama-server's tok/s under a schema (#50)",
        structured,
        short="structured output (JSON schema)",
        pending=True,
    ),
    Experiment(
        "edge runtime vs llama.cpp's Python server, Q4_1, and the response cache",
        "uv run python bench/edge/run.py",
        ("edge.md",),
        "`llama_cpp.server` (one request at a time) and llama-cpp-python in-process; same file "
        "and threads",
        "single stream >= 0.95x in-process; 8 clients >= 2x the Python server's tok/s; a cache "
        "hit < 5 ms (#5)",
        edge_python_server,
        short="edge runtime vs `llama_cpp.server`, Q4_1",
    ),
    Experiment(
        "edge: llama.cpp batch scaling per weight type (the kernels' ceiling)",
        "uv run python bench/edge/scaling.py --rounds 5",
        ("edge-scaling.md",),
        "",
        "",
        edge_scaling,
    ),
    Experiment(
        "edge: what slot order costs one llama.cpp decode step",
        "uv run python bench/edge/order.py",
        ("edge-order.json",),
        "",
        "",
        edge_order,
        diagnostic=True,
    ),
    Experiment(
        "cloud engine against its physical floor: the fp32 weight matmuls of one decode step "
        "(batch 1/8/32), HF transformers' step beside it",
        "uv run python bench/cloud/floor.py",
        ("cloud-floor.md",),
        "the step's weight matmuls alone (the floor); HF `LlamaForCausalLM` with a `DynamicCache`",
        "our step <= 1.2x the floor at batch 32 (#23)",
        cloud_floor,
        short="cloud engine vs its fp32 matmul floor",
    ),
    Experiment(
        "cloud engine vs HF transformers (1-64 concurrent, fixed and mixed lengths, prefix "
        "caching, a Mooncake replay)",
        (
            "uv run python bench/cloud/run.py --concurrency 1 4 16 32 64 --prompt-len 128 "
            "--output-len 128 --mixed-concurrency 32 --repeats 2 --mooncake-tokens-per-block 16 "
            "--mooncake-requests 32",
            "uv run python bench/cloud/run.py --parts sweep --concurrency 32 --output-len 128 "
            "--repeats 2 --mixed-concurrency 16 --out bench/results/cloud-out128",
            "uv run python bench/cloud/run.py --parts sweep --concurrency 1 --output-len 128 "
            "--repeats 2 --mixed-concurrency 32 --out bench/results/cloud-mixed32",
        ),
        ("cloud.md", "cloud-out128.md", "cloud-mixed32.md"),
        "HF transformers `generate`, one static batch of all requests (left-padded)",
        ">= 3x HF static batching's tok/s at 32 concurrent (#4)",
        cloud_hf,
        short="cloud engine vs HF transformers",
    ),
    Experiment(
        "disaggregated prefill/decode vs monolithic on the same 2 cores (interactive streams "
        "with long prompts mixed in)",
        "uv run python bench/disagg/run.py",
        ("disagg.md",),
        "the best monolithic setup on the same cores (2 or 1 torch threads, tuned step "
        "budgets); two single-core replicas",
        "interactive TBT p99 <= 0.5x the best monolithic setup's (#8, #23)",
        disagg("disagg"),
        short="disaggregated vs monolithic serving",
    ),
    Experiment(
        "the same under a heavier interactive load (more, longer streams; long prompts more often)",
        "uv run python bench/disagg/run.py --duration 40 --repeats 2 --short-rate 1.0 "
        "--short-len 48 --short-out 48 --long-every 4 --out bench/results/disagg-high-load",
        ("disagg-high-load.md",),
        "as above",
        "as above",
        disagg("disagg-high-load"),
        diagnostic=True,
        optional=True,
    ),
    Experiment(
        "gateway overhead and throughput, streaming (1, 64, 256, 1,000 concurrent streams)",
        "uv run python bench/gateway/run.py --litellm PATH/TO/litellm",
        ("gateway.md",),
        "LiteLLM's proxy (workers = cores, callbacks off, retries 0: its benchmark docs); Go's "
        "`httputil.ReverseProxy`; a bare TCP relay (the floor)",
        "p99 added TTFT <= 2 ms at 256 streams; throughput >= 3x LiteLLM's at the most load "
        "measured (#6)",
        gateway("gateway", stream=True),
        short="gateway, streaming",
    ),
    Experiment(
        "gateway overhead and throughput, non-streaming",
        "uv run python bench/gateway/run.py --no-stream --litellm PATH/TO/litellm",
        ("gateway-nonstream.md",),
        "as above",
        "throughput >= 3x LiteLLM's at the most load measured (#6, #23; the 2 ms p99 goal is "
        "for streams)",
        gateway("gateway-nonstream", stream=False),
        short="gateway, non-streaming",
        pending=True,
    ),
    Experiment(
        "gateway: two worker processes",
        "uv run python bench/gateway/run.py --concurrency 256 --targets direct,nullproxy,gateway "
        "--workers 2 --out gateway-workers2",
        ("gateway-workers2.md",),
        "",
        "",
        gateway_workers2,
        diagnostic=True,
    ),
    Experiment(
        "gateway: GC pauses, Python work per chunk, cross-CPU wake-up",
        "uv run python bench/gateway/diagnostics.py gc chunk wakeup",
        ("gateway-diagnostics.md",),
        "",
        "",
        gateway_diagnostics,
        diagnostic=True,
    ),
    Experiment(
        "Triton kernels vs torch references",
        "uv run python bench/kernels/run.py --reps 15",
        ("kernels-cpu.md",),
        "torch references; SDPA on contiguous K/V; a 16-bit matmul for W8A16",
        "paged decode attention >= 80% of peak HBM bandwidth on H100/H200 at context >= 4k, "
        "batch >= 32 (#9)",
        kernels,
        short="Triton kernels",
    ),
    Experiment(
        "model formats: quality and speed of every format",
        "uv run python bench/models/quality.py",
        ("models.md",),
        "torch fp32 (transformers)",
        "",
        models,
        short="model formats",
    ),
    Experiment(
        "ONNX int8 recipes on this CPU",
        "uv run python bench/models/int8_options.py",
        ("models-int8-options.md",),
        "ONNX fp32 (onnxruntime)",
        "",
        int8_options,
        short="ONNX int8 recipes",
    ),
    Experiment(
        "forecaster and autoscaling policies on real traces (simulated, test halves)",
        "uv run python bench/forecaster/run.py",
        ("forecaster.md", "forecaster/"),
        "the HPA at 70% (and `hpa-tuned`: the same scale-down knob as ours)",
        "the HPA's SLO attainment at <= 0.8x its replica-hours, or +5 SLO points at equal "
        "replica-hours (#7)",
        forecaster,
        short="predictive scaling vs the HPA (simulated)",
    ),
    Experiment(
        "autoscaling, closed loop: identical days with one sharp rise (local mode, real "
        "gateways, replicas with a load time)",
        "uv run python bench/autoscaling/replay.py --shape step --day-seconds 400 --bin-s 5 "
        "--modes reactive,hybrid,predictive",
        ("autoscaling-replay-step.md",),
        "`reactive`: the Kubernetes HPA's algorithm on the same metric",
        "",
        autoscaling_step,
        short="autoscaling, closed loop, a rise that repeats",
    ),
    Experiment(
        "autoscaling, closed loop: a compressed ServeGen segment",
        "uv run python bench/autoscaling/replay.py",
        ("autoscaling-replay.md",),
        "`reactive` (the HPA's algorithm); `reactive@0.5` (an HPA at a 50% target, the peer at "
        "equal spend)",
        "",
        autoscaling_servegen,
        short="autoscaling, closed loop, ServeGen",
    ),
    Experiment(
        "autoscaling, closed loop: capacity learned (`capacity` left out) against capacity "
        "typed from `hybridllm profile`, on serial-prefill replicas",
        "uv run python bench/autoscaling/replay.py --replica engine --slots 8 --peak-rps 6 "
        "--days 2 --modes reactive,reactive+auto",
        ("autoscaling-capacity.md",),
        "the same service with `hybridllm profile`'s figures typed into `capacity`",
        "learned within 15% of the profile's figures; SLO attainment and replica-seconds within "
        "the noise of the typed twin (#52)",
        autoscaling_capacity,
        short="autoscaling, capacity learned vs typed",
    ),
    Experiment(
        "autoscaling in a cluster: the operator on a real control plane (kwok pods) and a real "
        "Prometheus scraping real gateways",
        "uv run python bench/autoscaling/operator_replay.py",
        ("autoscaling-operator.md",),
        "`reactive`: the Kubernetes HPA's algorithm on the same metric",
        "`hybrid` sets the peak's replicas before a forecastable rise, `reactive` after it (#15)",
        autoscaling_operator,
        short="autoscaling in a cluster",
    ),
    Experiment(
        "rollout analysis: false aborts on A/A rollouts, detection of slower and failing canaries",
        "uv run python bench/rollout/analysis.py",
        ("rollout-analysis.md",),
        "",
        "A/A rollouts abort <= 5% of the time (the file's target)",
        rollout_analysis,
        short="rollout analysis",
    ),
    Experiment(
        "rollouts on the ServeGen trace: random against forecast-planned starts; in-place, "
        "forecast-blind canary, capacity-safe canary (simulated)",
        "uv run python bench/rollout/schedule.py --per-day 10",
        ("rollout-schedule.md",),
        "a Deployment's in-place rolling update; a canary that does not know demand (Argo "
        "Rollouts, KServe)",
        "",
        rollout_schedule,
        short="forecast-planned, capacity-safe rollouts",
    ),
    Experiment(
        "`hybridllm` start-up: `--help`, every `COMMAND --help`, `status`, `logs`, `down` and "
        "`rollout status`, each in a fresh process",
        "uv run python bench/cli/start.py --repeats 7",
        ("cli-start.md", "cli-start.json"),
        "`kubectl --help` and `helm --help` (Go binaries) on the same machine",
        "every command under 1 s on the 2-core machine (#55)",
        cli_start,
        short="`hybridllm` start-up",
        pending=True,
    ),
    Experiment(
        "the fleet server at 1,000 and 10,000 simulated devices, one and two replicas",
        "uv run python bench/fleet/run.py --devices 1000,10000 --replicas 1,2",
        ("fleet.md",),
        "",
        "",
        fleet,
    ),
    Experiment(
        "the operator at 100 and 1,000 LLMServices, demand from each gateway and from Prometheus",
        "uv run python bench/operator/scale.py --services 100,1000 --steady-seconds 300 "
        "--demand scrape,prometheus",
        ("operator-scale.md",),
        "the same children applied by `kubectl apply --server-side` alone",
        "Ready within 2x the kubectl baseline, under 300 MB, zero steady writes, under 5% of a "
        "core at rest (#28)",
        operator_scale,
        short="the operator at 1,000 services",
    ),
    Experiment(
        "the hybrid claim: monolithic vs disaggregated vs hybrid edge-cloud (local mode, the "
        "real gateway and runtimes, two cores in all) on agentic sessions from the SWE-agent "
        "trajectories: session and call latency, requests/s, edge share, cascades, CPU per "
        "component, cost per million tokens, and a quality guard",
        "uv run python bench/hybrid/run.py --sessions 12 --max-calls 6 --repeats 3",
        ("hybrid.md",),
        "monolithic and disaggregated cloud-only deployments on the same cores and sessions",
        "the published directions: hybrid fastest and cheapest, disaggregated faster than "
        "monolithic (#21)",
        hybrid,
        short="the hybrid claim (agentic sessions)",
        pending=True,
    ),
    Experiment(
        "the hybrid claim on the Mooncake conversation trace: multi-turn conversations "
        "rebuilt from shared prefix blocks, the trace's gaps between turns, the same three "
        "architectures and measures",
        "uv run python bench/hybrid/run.py --workload mooncake --sessions 12 --max-calls 6 "
        "--architectures monolithic,disaggregated,hybrid --repeats 3 "
        "--out bench/results/hybrid-mooncake",
        ("hybrid-mooncake.md",),
        "monolithic and disaggregated cloud-only deployments on the same cores and sessions",
        "the published directions: hybrid fastest and cheapest, disaggregated faster than "
        "monolithic (#21)",
        hybrid_mooncake,
        short="the hybrid claim (Mooncake conversations)",
        pending=True,
    ),
    Experiment(
        "the hybrid claim on multi-request workflows: the four workflow shapes' `mix` "
        "(sequential summaries, a copilot on a shared context, multi-agent teams) through the "
        "real gateway on the same three architectures and the balanced hybrid, every answer "
        "to 32 tokens",
        "uv run python bench/hybrid/run.py --workload workflows --shape mix --max-tokens 32 "
        "--architectures monolithic,disaggregated,hybrid,hybrid-balanced --repeats 3 "
        "--out bench/results/hybrid-workflows-gateway",
        ("hybrid-workflows-gateway.md",),
        "monolithic and disaggregated cloud-only deployments on the same cores and workflows",
        "the published directions: hybrid fastest and cheapest, disaggregated faster than "
        "monolithic (#21)",
        hybrid_workflows_gateway,
        short="the hybrid claim (workflows through the gateway)",
        pending=True,
    ),
    Experiment(
        "our session replay against guidellm on one request-level load (the `monolithic` "
        "service in local mode; ours before and after guidellm)",
        "uv run python bench/hybrid/crosscheck.py --guidellm PATH/TO/guidellm",
        ("hybrid-crosscheck.md",),
        "guidellm 0.8.1 (`concurrent` profile, synthetic prompts of the same token count)",
        "",
        hybrid_crosscheck,
        short="load generator cross-check (guidellm)",
        pending=True,
    ),
    Experiment(
        "beam search in the cloud engine: KV blocks and beam tokens/s at widths 4/8/16, "
        "beams sharing KV by reference against copy-per-beam and HF transformers' beam search, "
        "outputs checked identical",
        "uv run python bench/search/run.py",
        ("search-beams.md",),
        "HF transformers `generate(num_beams=W, do_sample=False)`; the same engine with sharing "
        "off (copy-per-beam)",
        "",
        search_beams,
        short="beam search with shared KV",
        pending=True,
    ),
    Experiment(
        "verifier-guided step search (`/v1/search`'s algorithm) against plain sampling at equal "
        "compute: accuracy on generated two-step arithmetic problems, search configurations "
        "K x B against majority vote and best-of-N given the search's tokens per problem",
        "uv run python bench/search/verifier.py",
        ("search-verifier.md",),
        "majority vote (self-consistency) and best-of-N by the same verifier, on the same "
        "engine, given the same compute per problem",
        "",
        search_verifier,
        short="verifier-guided step search",
        pending=True,
    ),
    Experiment(
        "multi-request workflows (summarise, copilot, multi-agent, mix) on the cloud engine: "
        "batch size and output cap against latency and CPU-seconds per output token",
        "uv run python bench/hybrid/workflows.py",
        ("hybrid-workflows.md",),
        "",
        "",
        hybrid_workflows,
        pending=True,
    ),
    Experiment(
        "the hybrid claim projected to the published scale (12,000 sessions, 2.4M calls a "
        "day): replicas per pool and cost per million tokens, sized by the request-level "
        "simulator calibrated with capacities measured here",
        "uv run python bench/hybrid/project.py",
        ("hybrid-projection.md",),
        "monolithic and disaggregated cloud-only pools sized the same way",
        "the published direction: hybrid cheapest (#21)",
        hybrid_projection,
        short="the hybrid claim at the published scale (projected)",
        pending=True,
    ),
    # Being built (bench/speculative/run.py): "not yet measured" until its results exist.
    Experiment(
        "speculative decoding in the cloud engine: n-gram (prompt-lookup) speculation on "
        "agentic and code prompts",
        "uv run python bench/speculative/run.py",
        ("speculative.md",),
        "the same engine without speculation; HF transformers' prompt-lookup decoding",
        "",
        speculative,
        short="speculative decoding",
    ),
)


# ---------------------------------------------------------------------------------------
# rendering

INDEX_START = "<!-- index:start (generated by `make bench-index` from bench/results/; edit bench/index.py) -->"  # fmt: skip
INDEX_END = "<!-- index:end -->"
PERF_START = "<!-- performance:start (generated by `make bench-index` from bench/results/; edit bench/index.py) -->"  # fmt: skip
PERF_END = "<!-- performance:end -->"


class IndexProblem(Exception):
    """A results file lacks what an extractor needs, or a README lacks its markers."""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def commands(e: Experiment) -> tuple[str, ...]:
    return (e.command,) if isinstance(e.command, str) else e.command


def measured(e: Experiment, r: Results) -> bool:
    return r.exists(e.results[0])


def headline(e: Experiment, r: Results) -> Headline:
    if not measured(e, r):
        return Headline("not yet measured", NOT_MEASURED)
    try:
        return e.extract(r)
    except (KeyError, IndexError, TypeError, ValueError, StopIteration) as exc:
        raise IndexProblem(
            f"{e.results[0]} ({e.name.split(':')[0]}): the results file lacks what bench/index.py "
            f"reads from it: {exc!r}"
        ) from exc


def links(e: Experiment, r: Results, prefix: str) -> str:
    out = []
    for name in e.results:
        if r.exists(name):
            out.append(f"[{name}]({prefix}{name})")
        else:
            out.append(f"{name} (not yet)")
    return ", ".join(out)


def rows(r: Results) -> list[tuple[Experiment, Headline]]:
    return [(e, headline(e, r)) for e in EXPERIMENTS if measured(e, r) or not e.optional]


def bench_table(r: Results) -> str:
    lines = [
        "| experiment | command | current results | peer | headline result | goal | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, h in rows(r):
        result = h.result + (f"; {h.detail}" if h.detail else "")
        peer = "; ".join(p for p in (e.peer, h.peer_note) if p)
        lines.append(
            "| "
            + " | ".join(
                cell(c)
                for c in (
                    e.name,
                    "; ".join(f"`{c}`" for c in commands(e)),
                    links(e, r, "results/"),
                    peer or "(none)",
                    result,
                    e.goal or "(none)",
                    h.met,
                )
            )
            + " |"
        )
    return "\n".join(lines)


def performance_table(r: Results) -> str:
    lines = [
        "Each row is an experiment with a peer or a goal, read from its current results file; "
        "ratios are against the peer measured in the same run, on shared 2-core CPU machines. "
        "Commands, peers' settings and the diagnostics: [bench/README.md](bench/README.md).",
        "",
        "| what | result, against the peer | goal | met | results |",
        "|---|---|---|---|---|",
    ]
    for e, h in rows(r):
        if not e.in_readme or not measured(e, r):
            continue
        main = e.results[0]
        lines.append(
            "| "
            + " | ".join(
                cell(c)
                for c in (
                    e.short or e.name,
                    h.result,
                    e.goal or "(none)",
                    h.met,
                    f"[{main}](bench/results/{main})",
                )
            )
            + " |"
        )
    return "\n".join(lines)


def splice(text: str, start: str, end: str, block: str, where: Path) -> str:
    """``text`` with what lies between the marker lines replaced by ``block``."""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < 0 or j < i:
        raise IndexProblem(f"{where}: the markers {start!r} and {end!r} are missing")
    return text[: i + len(start)] + "\n" + block + "\n" + text[j:]


def targets(root: Path) -> list[tuple[Path, str, str, Callable[[Results], str]]]:
    return [
        (root / "bench" / "README.md", INDEX_START, INDEX_END, bench_table),
        (root / "README.md", PERF_START, PERF_END, performance_table),
    ]


def generate(root: Path) -> dict[Path, tuple[str, str]]:
    """Each file's (current text, generated text)."""
    r = Results(root / "bench" / "results")
    out = {}
    for path, start, end, render in targets(root):
        current = path.read_text()
        out[path] = (current, splice(current, start, end, render(r), path))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="fail if a table differs instead of writing"
    )
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository root (default: this checkout)"
    )
    args = parser.parse_args(argv)
    try:
        files = generate(args.root)
    except IndexProblem as exc:
        print(f"bench/index.py: {exc}", file=sys.stderr)
        return 1
    stale = [path for path, (current, new) in files.items() if current != new]
    if args.check:
        for path in stale:
            print(
                f"{path.relative_to(args.root)}: the benchmark table is out of date with "
                "bench/results/.\nRun `make bench-index` and commit the result.",
                file=sys.stderr,
            )
        if not stale:
            print("README.md and bench/README.md match bench/results/")
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path][1])
        print(f"wrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
