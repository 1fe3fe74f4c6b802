"""Beam search: KV blocks and throughput, shared KV vs copy-per-beam vs HF transformers.

    uv run python bench/search/run.py [--widths 4 8 16] [--max-tokens 32] [--repeats 3]

Three peers run the same searches (``--prompts`` chat prompts that share a long system
prompt, beam widths ``--widths``, ``--max-tokens`` new tokens, length_penalty 1.0,
early_stopping false), one request at a time, alternating peer by peer in each repeat:

- **shared**: our engine, beams share their blocks by reference, copy on write of the
  last partial block when they split (the default);
- **copy-per-beam**: the same engine and process with sharing off (``_beam_share_kv =
  False``): a beam copies every block it shares on its first write after a split, so each
  beam holds a full table of its own, as an engine without shared KV does;
- **HF**: transformers' ``generate(num_beams=W, do_sample=False)`` (W copies of the prompt
  prefilled, cache rows reordered every step).

KV: the most blocks our pool had in use during any step (measured after scheduling); HF's
cache is W contiguous rows of prompt + generated tokens, given in blocks of the same size
(computed from its length, not measured). Throughput: beam tokens per second, width x search steps /
wall time (every peer runs the same steps: the outputs are checked identical). Medians over
``--repeats``; prefix caching off so that repeats do not hit each other's prompt.
Writes bench/results/search-beams.md and .json (machine, command, each peer's settings).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portable import git_head, model_path, portable, torch_machine_line

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

SYSTEM = (
    "You are a careful assistant for a team that runs language models in production. "
    "Answer in one or two sentences, plainly, without lists or headings. When a question "
    "is ambiguous, choose the most common reading and say which one you chose. Prefer "
    "concrete numbers and names over general statements, and never invent a source. "
    "If you do not know, say so. Keep units, and round numbers to two significant digits."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What does a KV cache store?",
    "Name a prime number larger than 50.",
]


def machine() -> str:
    return torch_machine_line()


def run_ours(
    engine: llm_engine.LLMEngine, prompt: list[int], params: SamplingParams, share: bool
) -> dict[str, Any]:
    engine._beam_share_kv = share
    engine.scheduler.peak_used = 0  # type: ignore[attr-defined]
    rid = f"s{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    request = engine.scheduler.requests[rid]
    assert request.beam_group is not None
    group = request.beam_group
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    wall = time.perf_counter() - t0
    peak = engine.scheduler.peak_used
    assert final is not None
    assert final.sequences is not None
    assert engine.kv.pool.num_used_blocks == 0, "blocks leaked"
    steps = group.cur_len - group.prompt_len
    return {
        "wall_s": wall,
        "steps": steps,
        "beam_tok_s": params.beam_width * steps / wall,
        "peak_blocks": peak,
        "group_peak_blocks": group.stats.peak_blocks,
        "one_table_per_beam_blocks": group.stats.peak_blocks_copy_per_beam,
        "block_copies": group.stats.num_block_copies,
        "sequences": [s.token_ids for s in final.sequences],
    }


def measure_peak_blocks(engine: llm_engine.LLMEngine) -> None:
    """Records the pool's blocks in use right after each scheduling, while the step's blocks
    are all held (after the step, beams not chosen have already given theirs back)."""
    scheduler, pool = engine.scheduler, engine.kv.pool
    schedule = scheduler.schedule

    def measured() -> Any:
        out = schedule()
        scheduler.peak_used = max(scheduler.peak_used, pool.num_used_blocks)  # type: ignore[attr-defined]
        return out

    scheduler.peak_used = 0  # type: ignore[attr-defined]
    scheduler.schedule = measured  # type: ignore[method-assign]


def run_hf(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]
) -> dict[str, Any]:
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=params.beam_width,
            do_sample=False,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.num_return_sequences,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
        wall = time.perf_counter() - t0
    seqs: list[list[int]] = []
    for row in out.tolist():
        cut: list[int] = []
        for token in row[len(prompt) :]:
            cut.append(token)
            if token in eos:
                break
        seqs.append(cut)
    return {"wall_s": wall, "sequences": seqs}


def median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def bench_width(
    engine: llm_engine.LLMEngine,
    hf: torch.nn.Module,
    prompts: list[list[int]],
    width: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        use_beam_search=True,
        beam_width=width,
        num_return_sequences=min(width, args.n),
    )
    eos = engine.info.eos_token_ids
    per_prompt: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        runs: dict[str, list[dict[str, Any]]] = {"shared": [], "copy": [], "hf": []}
        for _ in range(args.repeats):
            runs["shared"].append(run_ours(engine, prompt, params, share=True))
            runs["copy"].append(run_ours(engine, prompt, params, share=False))
            hf_run = run_hf(hf, prompt, params, eos)
            hf_run["steps"] = runs["shared"][-1]["steps"]
            hf_run["beam_tok_s"] = width * hf_run["steps"] / hf_run["wall_s"]
            runs["hf"].append(hf_run)
        shared, copy, ref = runs["shared"][0], runs["copy"][0], runs["hf"][0]
        identical = shared["sequences"] == copy["sequences"] == ref["sequences"]
        hf_tokens = len(prompt) + shared["steps"]
        row = {
            "prompt": i,
            "prompt_tokens": len(prompt),
            "steps": shared["steps"],
            "identical_outputs": identical,
            "shared": {
                k: median(runs["shared"], k) for k in ("wall_s", "beam_tok_s", "peak_blocks")
            },
            "copy": {k: median(runs["copy"], k) for k in ("wall_s", "beam_tok_s", "peak_blocks")},
            "hf": {
                "wall_s": median(runs["hf"], "wall_s"),
                "beam_tok_s": median(runs["hf"], "beam_tok_s"),
                "kv_blocks_equivalent": width * -(-hf_tokens // engine.info.block_size),
            },
            "group": {
                k: shared[k]
                for k in ("group_peak_blocks", "one_table_per_beam_blocks", "block_copies")
            },
            "all_runs": runs,
        }
        print(
            f"W={width} prompt {i}: blocks shared {row['shared']['peak_blocks']:.0f} / copy "
            f"{row['copy']['peak_blocks']:.0f} / HF~{row['hf']['kv_blocks_equivalent']}; "
            f"beam tok/s {row['shared']['beam_tok_s']:.1f} / {row['copy']['beam_tok_s']:.1f} / "
            f"{row['hf']['beam_tok_s']:.1f}; identical {identical}",
            flush=True,
        )
        per_prompt.append(row)
    return {"width": width, "per_prompt": per_prompt}


def render_markdown(report: dict[str, Any]) -> str:
    a = report["args"]
    lines = [
        "# Beam search: shared KV blocks vs copy-per-beam vs HF transformers",
        "",
        f"- date: {report['date']}; wall time of the run: {report['elapsed_s']:.0f} s",
        f"- machine: {report['machine']}",
        f"- command: `{report['command']}` (git {report['git']})",
        f"- model: {report['model']}, fp32, block size {a['block_size']} tokens",
        f"- searches: {len(report['prompt_tokens'])} chat prompts of "
        f"{', '.join(map(str, report['prompt_tokens']))} tokens (a shared system prompt + a "
        f"question), up to {a['max_tokens']} new tokens, length_penalty 1.0, early_stopping "
        f"false, top {a['n']} returned; one request at a time; medians of {a['repeats']} "
        "repeats, peers alternating within each repeat",
        "- peers: **shared** = our engine (beams share blocks by reference, copy on write of "
        "the last partial block); **copy-per-beam** = the same engine and process with "
        "sharing off (`_beam_share_kv = False`: each beam copies every block it shares on "
        "its first write after a split); **HF** = transformers "
        f"{report['transformers']} `generate(num_beams=W, do_sample=False)`; all three with "
        f"{a['threads']} torch thread(s), prefix caching off in ours",
        "- KV blocks: ours = most blocks in use in the pool during any step (measured after "
        "scheduling); HF = "
        "W rows of prompt + generated tokens in blocks of the same size (computed from the "
        "cache length, not measured). Beam tok/s = width x search steps / wall time, the "
        "same steps for every peer (outputs checked identical).",
        "",
        "| width | prompt tok | steps | KV blocks shared | copy-per-beam | HF (equiv.) "
        "| shared / copy | beam tok/s shared | copy-per-beam | HF | shared / HF "
        "| identical outputs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for w in report["widths"]:
        for r in w["per_prompt"]:
            s, c, h = r["shared"], r["copy"], r["hf"]
            lines.append(
                f"| {w['width']} | {r['prompt_tokens']} | {r['steps']} | {s['peak_blocks']:.0f} "
                f"| {c['peak_blocks']:.0f} | {h['kv_blocks_equivalent']} "
                f"| {s['peak_blocks'] / c['peak_blocks']:.2f} | {s['beam_tok_s']:.1f} "
                f"| {c['beam_tok_s']:.1f} | {h['beam_tok_s']:.1f} "
                f"| {s['beam_tok_s'] / h['beam_tok_s']:.2f}x "
                f"| {'yes' if r['identical_outputs'] else 'NO'} |"
            )
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--prompts", type=int, default=2, help="chat prompts (max 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=2, help="sequences returned")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=768)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="HF-layout dir (default: the model store's)")
    ap.add_argument("--out", default=str(RESULTS / "search-beams"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    import transformers
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = llm_engine.LLMEngine.from_path(
        path,
        llm_engine.EngineConfig(
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_model_len=2048,
            enable_prefix_caching=False,
        ),
    )
    assert engine.tokenizer is not None
    measure_peak_blocks(engine)
    prompts = [
        engine.tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in QUESTIONS[: args.prompts]
    ]
    t0 = time.time()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "command": " ".join(["uv run python bench/search/run.py", *sys.argv[1:]]),
        "git": git_head(),
        "model": portable(str(path)),
        "transformers": transformers.__version__,
        "args": {k: portable(str(v)) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "prompt_tokens": [len(p) for p in prompts],
        "peers": {
            "shared": "LLMEngine, beam KV shared by reference, copy on write",
            "copy": "the same LLMEngine with _beam_share_kv = False",
            "hf": f"transformers {transformers.__version__} generate(num_beams=W, do_sample=False)",
        },
    }
    report["widths"] = [bench_width(engine, hf, prompts, w, args) for w in args.widths]
    report["elapsed_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render_markdown(report))
    print(f"wrote {portable(str(out))}.md / .json in {report['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
