"""Cloud engine benchmark: our engine vs HF transformers' generate (static batches), same run.

    uv run python bench/cloud/run.py [--concurrency 1 4 16] [--prompt-len 64] [--output-len 32]

Parts (each writes into bench/results/cloud.json, .md and .png):
1. throughput/latency sweep: N concurrent requests (fixed prompt/output lengths and a mixed
   variant with lengths drawn from ../shared/traces/azure-2023 conv, scaled), ours
   (continuous batching) vs HF generate with one static batch of N vs ours sequential;
2. prefix sharing: requests that share a long system prompt (agentic shape: the system
   prompt of a ../shared/traces/swe-agent trajectory), prefix caching on vs off;
3. a Mooncake-shaped replay (../shared/traces/mooncake-2025): 512-token block ids mapped
   to our block size, caching on vs off, hit rate achieved vs the best possible.
Every number is the median of --repeats runs; ratios are against the peer of the same run.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portable import TRACES, git_head, model_path, portable, torch_machine_line

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def machine() -> str:
    return torch_machine_line()


def run_ours(engine: llm_engine.LLMEngine, prompts: list[list[int]], outs: list[int]) -> dict:
    """All requests submitted at t=0; TTFT per request, output tokens/s overall."""
    t0 = time.perf_counter()
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p, n in zip(ids, prompts, outs, strict=True):
        engine.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    ttft: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            ttft.setdefault(out.request_id, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": sum(outs) / wall, "ttft": sorted(ttft.values())}


def run_hf(model: torch.nn.Module, prompts: list[list[int]], outs: list[int]) -> dict:
    """One static batch (left-padded), generate to the longest output; TTFT = prefill step."""
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    n = max(outs)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(ids, attention_mask=mask)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=2)  # fmt: skip
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": sum(outs) / wall, "ttft": [ttft] * len(prompts)}


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)]


def summarise(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {
        "tok_s": statistics.median(r["tok_s"] for r in runs),
        "p95_ttft_s": statistics.median(p95(r["ttft"]) for r in runs),
        "median_ttft_s": statistics.median(statistics.median(r["ttft"]) for r in runs),
        "wall_s": best["wall_s"],
    }


def paired(fns: list, repeats: int) -> list[dict]:
    """Runs the contenders alternately (a, b, a, b, ...) so load drift hits both alike."""
    runs: list[list[dict]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            runs[i].append(fn())
    return [summarise(r) for r in runs]


def azure_lengths(n: int, scale: int, seed: int = 0) -> list[tuple[int, int]]:
    rows = list(csv.DictReader((TRACES / "azure-2023" / "AzureLLMInferenceTrace_conv.csv").open()))
    step = max(1, len(rows) // (n * 7 + 1))
    picked = rows[seed * 13 :: step][:n]
    return [(min(max(int(r["ContextTokens"]) // scale, 16), 512),
             min(max(int(r["GeneratedTokens"]) // scale, 4), 128)) for r in picked]  # fmt: skip


def make_engine(path: Path, caching: bool = True, **kw) -> llm_engine.LLMEngine:
    cfg = llm_engine.EngineConfig(num_kv_blocks=kw.pop("num_kv_blocks", 1024), max_model_len=2048,
                                  max_num_batched_tokens=kw.pop("budget", 512),
                                  enable_prefix_caching=caching, **kw)  # fmt: skip
    return llm_engine.LLMEngine.from_path(path, cfg)


def sweep(path: Path, hf: torch.nn.Module, args: argparse.Namespace) -> list[dict]:
    rows = []
    engine = make_engine(path, caching=False)
    for c in args.concurrency:
        prompts = [
            [(97 * i + 31 * j) % 40000 + 100 for j in range(args.prompt_len)] for i in range(c)
        ]
        outs = [args.output_len] * c
        ours, peer = paired(
            [
                lambda p=prompts, o=outs: run_ours(engine, p, o),
                lambda p=prompts, o=outs: run_hf(hf, p, o),
            ],
            args.repeats,
        )
        row = {"variant": "fixed", "concurrency": c, "ours": ours, "hf_static": peer,
               "ratio_vs_hf": ours["tok_s"] / peer["tok_s"]}  # fmt: skip
        if c == 1:
            row["sequential_tok_s"] = ours["tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    seq = rows[0]["ours"]["tok_s"] if rows and rows[0]["concurrency"] == 1 else None
    for row in rows:
        row["ratio_vs_sequential"] = row["ours"]["tok_s"] / seq if seq else None
    c = args.mixed_concurrency
    lengths = azure_lengths(c, args.azure_scale)
    prompts = [
        [(53 * i + 7 * j) % 40000 + 100 for j in range(pl)] for i, (pl, _) in enumerate(lengths)
    ]
    outs = [ol for _, ol in lengths]
    ours, peer = paired(
        [lambda: run_ours(engine, prompts, outs), lambda: run_hf(hf, prompts, outs)],
        args.repeats,
    )
    row = {"variant": f"azure-conv mixed (lengths / {args.azure_scale})", "concurrency": c,
           "ours": ours, "hf_static": peer, "ratio_vs_hf": ours["tok_s"] / peer["tok_s"],
           "lengths": lengths}  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def swe_system_prompt() -> str:
    """The shared head of an agent session: system prompt + the task/instructions message."""
    traj = json.loads((TRACES / "swe-agent" / "function_calling_simple.traj").read_text())
    history = traj["history"]
    return "\n".join(str(m.get("content", "")) for m in history[:2])


def prefix_sharing(path: Path, args: argparse.Namespace) -> dict:
    probe = make_engine(path)
    assert probe.tokenizer is not None
    system = probe.tokenizer.encode(swe_system_prompt())[: args.system_len]
    prompts = [system + probe.tokenizer.encode(f" Task {i}: fix issue number {i * 7} in module m{i}.")
               for i in range(args.prefix_requests)]  # fmt: skip
    outs = [args.prefix_output_len] * len(prompts)
    result = {"system_prompt_tokens": len(system), "requests": len(prompts)}
    result["on"], result["off"] = paired(
        [
            lambda: run_ours(make_engine(path, caching=True), prompts, outs),
            lambda: run_ours(make_engine(path, caching=False), prompts, outs),
        ],
        args.repeats,
    )
    result["ttft_speedup"] = result["off"]["median_ttft_s"] / result["on"]["median_ttft_s"]
    result["throughput_ratio"] = result["on"]["tok_s"] / result["off"]["tok_s"]
    print(json.dumps(result), flush=True)
    return result


def mooncake(path: Path, args: argparse.Namespace) -> dict:
    """Replay in arrival order (closed loop, --mooncake-concurrency at a time)."""
    lines = (TRACES / "mooncake-2025" / "conversation_trace.jsonl").read_text().splitlines()
    reqs = [json.loads(ln) for ln in lines[: args.mooncake_requests]]
    bs, tok_per_block = 16, args.mooncake_tokens_per_block
    prompts, seen, best_hit, total = [], set(), 0, 0
    max_blocks = args.mooncake_max_tokens // tok_per_block
    for r in reqs:
        ids: list[int] = []
        r["hash_ids"] = r["hash_ids"][:max_blocks]
        for h in r["hash_ids"]:
            ids += [(h * 131 + k * 17) % 40000 + 100 for k in range(tok_per_block)]
        prompts.append(ids)
        # best possible: leading blocks whose whole chain was seen before (unbounded cache)
        chain, hit = (), 0
        for h in r["hash_ids"]:
            chain = (*chain, h)
            if chain in seen and hit == len(chain) - 1:
                hit += 1
            seen.add(chain)
        best_hit += min(hit * tok_per_block, (len(ids) - 1) // bs * bs)
        total += len(ids)
    outs = [min(max(r["output_length"] // 32, 4), 32) for r in reqs]
    result = {"requests": len(reqs), "tokens_per_512_block": tok_per_block,
              "best_possible_hit_rate": best_hit / total}  # fmt: skip
    for caching in (True, False):
        engine = make_engine(path, caching=caching)
        t0 = time.perf_counter()
        tok = 0
        ttfts: list[float] = []
        for start in range(0, len(prompts), args.mooncake_concurrency):
            r = run_ours(engine, prompts[start : start + args.mooncake_concurrency],
                         outs[start : start + args.mooncake_concurrency])  # fmt: skip
            ttfts += r["ttft"]
            tok += sum(outs[start : start + args.mooncake_concurrency])
        wall = time.perf_counter() - t0
        stats = engine.stats()
        result["on" if caching else "off"] = {
            "tok_s": tok / wall, "median_ttft_s": statistics.median(ttfts),
            "p95_ttft_s": p95(ttfts), "hit_rate": stats.prefix_hit_rate, "wall_s": wall,
        }  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in report["sweep"] if r["variant"] == "fixed"]
    cs = [r["concurrency"] for r in fixed]
    caching = "prefix" in report and "mooncake" in report
    fig, ax = plt.subplots(1, 3 if caching else 2, figsize=(15 if caching else 10, 4.5))
    ax[0].plot(cs, [r["ours"]["tok_s"] for r in fixed], "o-", label="ours (continuous batching)")
    ax[0].plot(
        cs, [r["hf_static"]["tok_s"] for r in fixed], "s--", label="HF generate (static batch)"
    )
    ax[0].axhline(fixed[0]["ours"]["tok_s"], color="gray", ls=":", label="ours sequential")
    ax[0].set(
        xlabel="concurrent requests", ylabel="output tokens/s", xscale="log", title="Throughput"
    )
    ax[0].legend()
    ax[1].plot(cs, [r["ours"]["p95_ttft_s"] for r in fixed], "o-", label="ours p95 TTFT")
    ax[1].plot(cs, [r["hf_static"]["p95_ttft_s"] for r in fixed], "s--", label="HF prefill time")
    ax[1].set(
        xlabel="concurrent requests", ylabel="seconds", xscale="log", title="Time to first token"
    )
    ax[1].legend()
    if not caching:
        fig.suptitle(
            f"hybridllm cloud engine, SmolLM2-135M fp32 on CPU — {report['machine']}", fontsize=9
        )
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        return
    pre, moon = report["prefix"], report["mooncake"]
    labels = ["shared system\nprompt TTFT", "mooncake\nTTFT"]
    on = [pre["on"]["median_ttft_s"], moon["on"]["median_ttft_s"]]
    off = [pre["off"]["median_ttft_s"], moon["off"]["median_ttft_s"]]
    x = range(len(labels))
    ax[2].bar([i - 0.2 for i in x], on, 0.4, label="prefix caching on")
    ax[2].bar([i + 0.2 for i in x], off, 0.4, label="prefix caching off")
    ax[2].set_xticks(list(x), labels)
    ax[2].set(ylabel="median TTFT (s)", title="Prefix sharing")
    ax[2].legend()
    fig.suptitle(
        f"hybridllm cloud engine, SmolLM2-135M fp32 on CPU — {report['machine']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def render_markdown(report: dict, out_name: str = "cloud") -> str:
    lines = [
        "# Cloud engine benchmark (CPU)",
        "",
        f"- machine: {report['machine']}",
        f"- command: `{report['command']}` (git {report['git']}, {report['elapsed_s']:.0f} s)",
        f"- model: SmolLM2-135M-Instruct, {report['dtype']}, from `{report['model']}`",
        "- peer in the same run: HF transformers `generate` with one static batch of all N"
        " requests (left-padded, runs to the longest output); 'sequential' = ours at N=1",
        f"- medians over {report['args']['repeats']} runs; all requests arrive at t=0;"
        " greedy, ignore_eos",
        "",
        "## Throughput and TTFT",
        "",
        "| variant | N | ours tok/s | HF static tok/s | ours / HF | ours / sequential |"
        " ours p95 TTFT (s) | HF prefill (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["sweep"]:
        seq = r.get("ratio_vs_sequential")
        lines.append(
            f"| {r['variant']} | {r['concurrency']} | {r['ours']['tok_s']:.1f} | "
            f"{r['hf_static']['tok_s']:.1f} | **{r['ratio_vs_hf']:.2f}x** | "
            f"{'' if seq is None else f'{seq:.2f}x'} | {r['ours']['p95_ttft_s']:.2f} | "
            f"{r['hf_static']['p95_ttft_s']:.2f} |"
        )
    if "prefix" not in report or "mooncake" not in report:
        return "\n".join([*lines, "", f"![plot]({out_name}.png)", ""])
    pre, moon = report["prefix"], report["mooncake"]
    lines += [
        "",
        "## Prefix sharing",
        "",
        f"Shared system prompt (agentic shape: the system prompt of"
        f" `swe-agent/function_calling_simple.traj`, cut to {pre['system_prompt_tokens']}"
        f" tokens) + a distinct task line, {pre['requests']} requests at once:",
        "",
        "| prefix caching | tok/s | median TTFT (s) | p95 TTFT (s) |",
        "|---|---|---|---|",
        f"| on | {pre['on']['tok_s']:.1f} | {pre['on']['median_ttft_s']:.2f} |"
        f" {pre['on']['p95_ttft_s']:.2f} |",
        f"| off | {pre['off']['tok_s']:.1f} | {pre['off']['median_ttft_s']:.2f} |"
        f" {pre['off']['p95_ttft_s']:.2f} |",
        "",
        f"TTFT speed-up {pre['ttft_speedup']:.2f}x, throughput ratio"
        f" {pre['throughput_ratio']:.2f}x.",
        "",
        f"Mooncake replay (`mooncake-2025/conversation_trace.jsonl`, first {moon['requests']}"
        f" requests in arrival order, each 512-token block id mapped to"
        f" {moon['tokens_per_512_block']} tokens, i.e. lengths scaled by"
        f" 1/{512 // moon['tokens_per_512_block']}; closed loop, batches of"
        f" {report['args']['mooncake_concurrency']}):",
        "",
        "| prefix caching | tok/s | median TTFT (s) | p95 TTFT (s) | hit rate |",
        "|---|---|---|---|---|",
    ]
    for key in ("on", "off"):
        m = moon[key]
        lines.append(
            f"| {key} | {m['tok_s']:.1f} | {m['median_ttft_s']:.2f} | {m['p95_ttft_s']:.2f} |"
            f" {m['hit_rate']:.1%} |"
        )
    lines += [
        "",
        f"Best possible hit rate on this replay (unbounded cache, whole-prefix chains):"
        f" {moon['best_possible_hit_rate']:.1%}.",
        "",
        f"![plot]({out_name}.png)",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF-layout dir (default: the model store's SmolLM2)"
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mixed-concurrency", type=int, default=16)
    ap.add_argument("--azure-scale", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--prefix-requests", type=int, default=8)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--mooncake-requests", type=int, default=24)
    ap.add_argument("--mooncake-tokens-per-block", type=int, default=16)
    ap.add_argument("--mooncake-concurrency", type=int, default=8)
    ap.add_argument("--mooncake-max-tokens", type=int, default=1536, help="prompt cap")
    ap.add_argument(
        "--resume-log",
        default=None,
        help="take the sweep rows printed by an earlier run's log instead of re-running them",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--parts",
        default="sweep,prefix,mooncake",
        help="comma-separated parts to run (sweep, prefix, mooncake)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both engines (a shared, oversubscribed machine runs "
        "2 OpenMP threads ~5x slower than 1)",
    )
    ap.add_argument("--out", default=str(RESULTS / "cloud"))
    ap.add_argument("--render-only", action="store_true", help="rewrite .md/.png from .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render_only:
        report = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(render_markdown(report, out.name))
        plot(report, out.with_suffix(".png"))
        return 0
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t0 = time.time()
    report = {"machine": machine(), "command": " ".join(["uv run python bench/cloud/run.py", *sys.argv[1:]]),
              "git": git_head(),
              "model": portable(str(path)), "dtype": "float32", "args": vars(args)}  # fmt: skip
    if args.resume_log:
        rows = [json.loads(ln) for ln in Path(args.resume_log).read_text().splitlines()
                if ln.startswith('{"variant"')]  # fmt: skip
        seq = next((r["ours"]["tok_s"] for r in rows if r["concurrency"] == 1), None)
        for r in rows:
            if r["variant"] == "fixed" and seq:
                r["ratio_vs_sequential"] = r["ours"]["tok_s"] / seq
        report["sweep_from_log"] = args.resume_log
        report["sweep"] = rows
    else:
        report["sweep"] = sweep(path, hf, args)
    parts = set(args.parts.split(","))
    if "prefix" in parts:
        report["prefix"] = prefix_sharing(path, args)
    if "mooncake" in parts:
        report["mooncake"] = mooncake(path, args)
    report["elapsed_s"] = time.time() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render_markdown(report, out.name))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out}.json / .png in {report['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
