"""Multi-request workflows and their knobs: batch size and output cap against latency and
energy, on the cloud engine.

    uv run python bench/hybrid/workflows.py [--batches 1 4 16] [--output-caps 16 64]

The four workflow shapes of ``shapes.py`` (``summarise``, ``copilot``, ``multi-agent``,
``mix``: built from the SWE-agent trajectories' text, scaled to SmolLM2-135M-Instruct on two
cores). A workflow is a set of chains; a chain's calls run in order, each sent when the
previous one answered (its prompt may hold the chain's earlier answers).

The knobs: ``--batches`` (the engine's ``max_num_seqs``: how many calls run together) and
``--output-caps`` (``max_tokens``: every answer is generated to the cap, ``ignore_eos``, so
output length is the knob and not the model's choice). Each combination runs on a fresh
engine (an empty prefix cache) over the same loaded weights, fp32, ``--threads`` torch
threads, greedy.

Energy: this machine exposes no RAPL (``/sys/class/powercap`` is absent in the VM) and no
GPU, so energy is given as **CPU-seconds per output token** (the process's CPU time over
the run, all threads), labelled as such everywhere. Also reported: the workflow's
wall time (makespan), call latency p50/p95, output tokens/s and the prefix cache's hit rate.
Writes bench/results/hybrid-workflows.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from portable import git_head, model_path, portable, torch_machine_line
from shapes import SHAPES, Chain, load_sources, workflow

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def run(engine: llm_engine.LLMEngine, chains: list[Chain], cap: int) -> dict[str, Any]:
    """Every chain from t=0, each call sent when its chain's previous one answered."""
    assert engine.tokenizer is not None
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=cap, temperature=0.0, ignore_eos=True)
    answers: list[list[str]] = [[] for _ in chains]
    sent: dict[str, tuple[int, float]] = {}
    latencies: list[float] = []
    out_tokens = prompt_tokens = cached = 0

    def send(c: int) -> None:
        nonlocal prompt_tokens
        k = len(answers[c])
        messages = chains[c].calls[k](list(answers[c]))
        prompt = tok.encode_chat(messages)
        prompt_tokens += len(prompt)
        request_id = f"{c}-{k}"
        sent[request_id] = (c, time.perf_counter())
        engine.add_request(request_id, prompt, params)

    cpu0, t0 = time.process_time(), time.perf_counter()
    for c in range(len(chains)):
        send(c)
    while engine.has_unfinished():
        for out in engine.step():
            if not out.finished:
                continue
            c, at = sent.pop(out.request_id)
            latencies.append(time.perf_counter() - at)
            out_tokens += len(out.token_ids)
            cached += out.num_cached_tokens
            answers[c].append(out.text)
            if len(answers[c]) < len(chains[c].calls):
                send(c)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    latencies.sort()
    return {
        "calls": len(latencies),
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        "output_tok_s": out_tokens / wall,
        "cpu_s_per_output_token": cpu / out_tokens,
        "cpu_s_per_workflow": cpu / len(chains),
    }


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Multi-request workflows: batch size and output cap against latency and energy",
        "",
        f"- machine: {report['machine']}",
        f"- commit: {report['commit']}",
        f"- command: `{report['command']}`",
        "- engine: the cloud engine in-process, SmolLM2-135M-Instruct fp32, prefix caching on, "
        "chunked prefill (512-token steps), a fresh engine (empty cache) per cell, greedy, every "
        "answer generated to the cap (`ignore_eos`)",
        "- workflows (`bench/hybrid/workflows.py`, text from the SWE-agent trajectories): "
        "`summarise` 4 documents x 4 sequential parts (no shared long prompt); `copilot` 8 "
        "users x 2 questions on one shared ~700-token context; `multi-agent` 2 teams x 3 "
        "agents x 2 rounds, each call holding the team's long instructions and the growing "
        "transcript; `mix` all three at once",
        "- **energy is CPU-seconds per output token** (this VM has no RAPL and no GPU): the "
        "process's CPU time over the cell, all threads",
        f"- knobs: batch size (`max_num_seqs`) {', '.join(map(str, s['batches']))}; output cap "
        f"(`max_tokens`) {', '.join(map(str, s['output_caps']))}; {s['repeats']} repeat(s), medians",
        "",
    ]
    chains = report.get("chains") or {}
    for shape in s["shapes"]:
        lines += [
            f"## {shape}",
            "",
            f"{chains.get(shape, '?')} chains: at most that many calls in flight, whatever the "
            "batch size.",
            "",
            "| batch | output cap | wall s | call p50 s | call p95 s | output tok/s | CPU-s per "
            "output token | CPU-s per workflow | prefix hit |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for cell in report["cells"]:
            if cell["shape"] != shape:
                continue
            m = cell["median"]
            lines.append(
                f"| {cell['batch']} | {cell['output_cap']} | {m['wall_s']:.1f} | "
                f"{m['latency_p50_s']:.2f} | {m['latency_p95_s']:.2f} | {m['output_tok_s']:.1f} | "
                f"{m['cpu_s_per_output_token']:.3f} | {m['cpu_s_per_workflow']:.1f} | "
                f"{m['prefix_hit_rate']:.0%} |"
            )
        lines.append("")
    lines += ["## The levers", "", *report["findings"], ""]
    return "\n".join(lines)


def findings(report: dict[str, Any]) -> list[str]:
    """Batch size's effect per shape (smallest to largest batch, at the largest cap), and
    output cap's (CPU per workflow against output tokens, at the largest batch)."""
    s = report["settings"]
    lo, hi = min(s["batches"]), max(s["batches"])
    short, long = min(s["output_caps"]), max(s["output_caps"])

    def cell(shape: str, batch: int, cap: int) -> dict[str, float]:
        return next(c["median"] for c in report["cells"]
                    if (c["shape"], c["batch"], c["output_cap"]) == (shape, batch, cap))  # fmt: skip

    out = []
    chains = report.get("chains") or {}
    for shape in s["shapes"]:
        a, b = cell(shape, lo, long), cell(shape, hi, long)
        n = chains.get(shape)
        note = f" ({n} chains: at most {n} in flight)" if n is not None and n < hi else ""
        out.append(
            f"- `{shape}`, batch {lo} -> {hi}{note} (cap {long}): CPU-s per output token "
            f"{b['cpu_s_per_output_token'] / a['cpu_s_per_output_token']:.2f}x, wall time "
            f"{b['wall_s'] / a['wall_s']:.2f}x, call p95 {b['latency_p95_s'] / a['latency_p95_s']:.2f}x; "
            f"cap {short} -> {long} (batch {hi}): output tokens "
            f"{cell(shape, hi, long)['output_tokens'] / cell(shape, hi, short)['output_tokens']:.1f}x, "
            f"CPU-s per workflow "
            f"{cell(shape, hi, long)['cpu_s_per_workflow'] / cell(shape, hi, short)['cpu_s_per_workflow']:.2f}x"
        )
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["settings"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for shape in s["shapes"]:
        for ax, key in zip(axes, ("cpu_s_per_output_token", "latency_p95_s"), strict=True):
            cap = max(s["output_caps"])
            xs = s["batches"]
            ys = [next(c["median"][key] for c in report["cells"]
                       if (c["shape"], c["batch"], c["output_cap"]) == (shape, b, cap)) for b in xs]  # fmt: skip
            ax.plot(xs, ys, marker="o", label=shape)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (max_num_seqs)")
    axes[0].set_ylabel("CPU-seconds per output token (energy proxy)")
    axes[1].set_ylabel("call latency p95 (s)")
    axes[0].legend()
    fig.suptitle(f"Workflows on the cloud engine, output cap {max(s['output_caps'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF-layout directory (default: the model store's)"
    )
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--output-caps", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "hybrid-workflows"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = llm_engine.LLMEngine.from_path(
        model_path(args.model), llm_engine.EngineConfig(num_kv_blocks=2048, block_size=16)
    )
    sources = load_sources()
    cells = []
    for shape in args.shapes:
        for batch in args.batches:
            for cap in args.output_caps:
                runs = []
                for _ in range(args.repeats):
                    engine = llm_engine.LLMEngine(
                        base.model, base.tokenizer,
                        llm_engine.EngineConfig(num_kv_blocks=2048, block_size=16, max_num_seqs=batch),
                    )  # fmt: skip
                    runs.append(run(engine, workflow(shape, sources), cap))
                median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                cells.append({"shape": shape, "batch": batch, "output_cap": cap, "runs": runs,
                              "median": median})  # fmt: skip
                print(f"  {shape} batch {batch} cap {cap}: {median['wall_s']:.1f} s, "
                      f"{median['cpu_s_per_output_token']:.3f} CPU-s/token", file=sys.stderr,
                      flush=True)  # fmt: skip
    report: dict[str, Any] = {
        "machine": torch_machine_line(),
        "commit": git_head(),
        "command": portable(
            " ".join(["uv run python bench/hybrid/workflows.py", *(argv or sys.argv[1:])])
        ),
        "settings": {
            "shapes": args.shapes,
            "batches": args.batches,
            "output_caps": args.output_caps,
            "repeats": args.repeats,
            "threads": args.threads,
        },
        "cells": cells,
    }
    report["chains"] = {shape: len(workflow(shape, sources)) for shape in args.shapes}
    report["findings"] = findings(report)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render(report))
    plot(report, out.with_suffix(".png"))
    print(render(report))
    return 0


def rerender(saved: Path) -> None:
    """The report again from a saved JSON (``--render PATH.json``): adds what newer code
    records (the chain counts) and rewrites the .md, .png and .json."""
    report = json.loads(saved.read_text())
    if "chains" not in report:
        sources = load_sources()
        report["chains"] = {s: len(workflow(s, sources)) for s in report["settings"]["shapes"]}
    report["findings"] = findings(report)
    saved.write_text(json.dumps(report, indent=2))
    saved.with_suffix(".md").write_text(render(report))
    plot(report, saved.with_suffix(".png"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--render"]:
        rerender(Path(sys.argv[2]))
        raise SystemExit(0)
    sys.exit(main())
