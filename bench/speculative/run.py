"""Speculative decoding benchmark: acceptance rate and speedup on agentic and code prompts.

    uv run python bench/speculative/run.py [--prompts-per-kind 3] [--output-len 64] [--repeats 3]

Prompts come from the SWE-agent trajectories in ../shared/traces/swe-agent (files in name
order), in two kinds:

- agentic: the conversation an agent had before one of its model calls (system prompt cut
  to its first --system-chars characters, then the newest turns that fit in
  --max-prompt-tokens), the model writes the next turn;
- code: a file the agent opened (SWE-agent's numbered ``[File: ...]`` view), with the
  request to write it out again without the line numbers.

Contenders, one request at a time (speculation's use case: latency at low load), greedy,
every prompt run by every contender in turn within each repeat, medians over repeats:

- ours, no speculation; ours with n-gram speculation (the default settings of
  ``--speculative-method ngram``); ours with a truncated-layer draft (the target's first
  --draft-layers layers);
- HF transformers ``generate`` (fp32, same weights), plain and with
  ``prompt_lookup_num_tokens`` (its prompt-lookup decoding), the peer.

Scaled to the 2-core CPU machine: --prompts-per-kind prompts of at most --max-prompt-tokens
tokens (the traces' prompts reach 14k tokens) and --output-len new tokens each, one torch
thread. Writes bench/results/speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(BENCH))
from portable import TRACES, git_head, model_path  # noqa: E402

Chat = list[dict[str, str]]

# --- prompts (pure: no model) -------------------------------------------------------------


def load_trajectories(folder: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """(file name, history) of every trajectory, in file-name order."""
    out = []
    for path in sorted(folder.glob("*.traj")):
        history = json.loads(path.read_text())["history"]
        out.append((path.name, history))
    return out


def _message(m: dict[str, Any]) -> dict[str, str]:
    """A history entry as a chat message: tool output is what the agent was told (user)."""
    role = m.get("role", "user")
    return {"role": role if role in ("system", "user", "assistant") else "user",
            "content": str(m.get("content", ""))}  # fmt: skip


def agentic_chats(
    trajectories: list[tuple[str, list[dict[str, Any]]]], n: int, system_chars: int
) -> list[tuple[str, Chat]]:
    """Per trajectory (in order, until ``n``): the turns before its middle model call."""
    out: list[tuple[str, Chat]] = []
    for name, history in trajectories:
        calls = [i for i, m in enumerate(history) if m.get("role") == "assistant"]
        if len(calls) < 2:
            continue
        cut = calls[len(calls) // 2]
        chat = [_message(m) for m in history[:cut]]
        if chat and chat[0]["role"] == "system":
            chat[0]["content"] = chat[0]["content"][:system_chars]
        out.append((name, chat))
        if len(out) == n:
            break
    return out


FILE_VIEW = re.compile(r"^\[File: (?P<path>[^\]]+)\]\n(?P<body>(?:\d+:.*\n?){8,})", re.MULTILINE)


def code_chats(
    trajectories: list[tuple[str, list[dict[str, Any]]]], n: int, max_lines: int
) -> list[tuple[str, Chat]]:
    """Per trajectory (in order, until ``n``): its first file view of a file not seen
    before, as 'write this out without the line numbers'."""
    out: list[tuple[str, Chat]] = []
    seen: set[str] = set()
    for name, history in trajectories:
        for m in history:
            match = FILE_VIEW.search(str(m.get("content", "")))
            if match is None or match["path"] in seen:
                continue
            seen.add(match["path"])
            lines = match["body"].splitlines()[:max_lines]
            ask = (
                f"Here is {match['path']} as the editor shows it:\n" + "\n".join(lines)
                + "\n\nWrite this code out again exactly, without the line numbers."
            )  # fmt: skip
            out.append((name, [{"role": "user", "content": ask}]))
            break
        if len(out) == n:
            break
    return out


def fit(encode: Callable[[Chat], list[int]], chat: Chat, max_tokens: int) -> list[int]:
    """The chat's tokens within ``max_tokens``: the oldest turns after the system prompt go
    first (order is kept), and a single turn still too long loses its beginning."""
    chat = list(chat)
    ids = encode(chat)
    while len(ids) > max_tokens and len(chat) > 2:
        del chat[1 if chat[0]["role"] == "system" else 0]
        ids = encode(chat)
    return ids[-max_tokens:]


def ratio(new: float, base: float) -> float:
    """``new / base`` (a speedup when both are rates, tokens/s); 0 when base is 0."""
    return new / base if base else 0.0


def summarise(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-prompt medians -> one row: tokens over time summed, median TPOT and TTFT."""
    tokens = sum(r["tokens"] for r in runs)
    wall = sum(r["e2e_s"] for r in runs)
    return {
        "tokens": tokens,
        "tok_s": tokens / wall if wall else 0.0,
        "tpot_ms": statistics.median(r["tpot_s"] for r in runs) * 1e3,
        "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
    }


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --- contenders -----------------------------------------------------------------------------


def _timing(t0: float, first: float | None, end: float, n: int) -> dict[str, float]:
    ttft = (first or end) - t0
    return {"tokens": n, "e2e_s": end - t0, "ttft_s": ttft,
            "tpot_s": (end - t0 - ttft) / (n - 1) if n > 1 else 0.0}  # fmt: skip


def run_ours(engine: Any, prompt: list[int], max_tokens: int) -> tuple[dict[str, float], list[int]]:
    from hybridllm_cloud.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rid = f"b{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            tokens = out.token_ids
    return _timing(t0, first, time.perf_counter(), len(tokens)), tokens


def run_hf(
    model: Any, prompt: list[int], max_tokens: int, lookup: dict[str, int] | None
) -> tuple[dict[str, float], list[int]]:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class FirstToken(StoppingCriteria):
        """Called after every accepted chunk: the first call is the first token."""

        first: float | None = None

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.first = self.first or time.perf_counter()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    watch = FirstToken()
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, stopping_criteria=StoppingCriteriaList([watch]),
            pad_token_id=model.config.eos_token_id, **(lookup or {}),
        )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return _timing(t0, watch.first, time.perf_counter(), len(tokens)), tokens


# --- the run --------------------------------------------------------------------------------


def spec_counts(engine: Any) -> tuple[int, int, int]:
    st = engine.stats()
    return st.num_spec_drafts, st.num_spec_draft_tokens, st.num_spec_accepted_tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridllm_cloud.engine import llm_engine
    from hybridllm_cloud.spec_decode.config import SpeculativeConfig

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    ngram_cfg = SpeculativeConfig("ngram", args.k)
    draft_cfg = SpeculativeConfig("draft", args.draft_k, draft_num_layers=args.draft_layers)

    def engine(spec: SpeculativeConfig) -> Any:
        config = llm_engine.EngineConfig(
            num_kv_blocks=args.kv_blocks, max_model_len=args.max_prompt_tokens + args.output_len + 16,
            speculative=spec,
        )  # fmt: skip
        return llm_engine.LLMEngine.from_path(path, config)

    ours = {"ours": engine(SpeculativeConfig()), "ours-ngram": engine(ngram_cfg)}
    if args.draft_layers:
        ours["ours-draft"] = engine(draft_cfg)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lookup = {"prompt_lookup_num_tokens": args.k, "max_matching_ngram_size": args.hf_max_ngram}
    tok = ours["ours"].tokenizer
    trajectories = load_trajectories(Path(args.traces))
    kinds = {
        "agentic": agentic_chats(trajectories, args.prompts_per_kind, args.system_chars),
        "code": code_chats(trajectories, args.prompts_per_kind, args.code_lines),
    }
    prompts = {
        kind: [(name, fit(tok.encode_chat, chat, args.max_prompt_tokens)) for name, chat in chats]
        for kind, chats in kinds.items()
    }
    contenders: dict[str, Callable[[list[int]], tuple[dict[str, float], list[int]]]] = {
        name: (lambda p, e=e: run_ours(e, p, args.output_len)) for name, e in ours.items()
    }
    contenders["hf"] = lambda p: run_hf(hf, p, args.output_len, None)
    contenders["hf-prompt-lookup"] = lambda p: run_hf(hf, p, args.output_len, lookup)
    draft_kinds = set(args.draft_kinds.split(","))
    for kind, items in prompts.items():  # warm-up: first calls pay allocation and caches
        for name, fn in contenders.items():
            if name != "ours-draft" or kind in draft_kinds:
                fn(items[0][1][-64:])
    report_kinds: dict[str, Any] = {}
    for kind, items in prompts.items():
        names = [n for n in contenders if n != "ours-draft" or kind in draft_kinds]
        before = {n: spec_counts(e) for n, e in ours.items()}
        runs: dict[str, list[list[dict[str, float]]]] = {n: [[] for _ in items] for n in names}
        outputs: dict[str, list[list[int]]] = {n: [[] for _ in items] for n in names}
        for rep in range(args.repeats):
            for i, (_, prompt) in enumerate(items):
                order = names if (rep + i) % 2 == 0 else names[::-1]  # alternate who goes first
                for name in order:
                    timing, tokens = contenders[name](prompt)
                    runs[name][i].append(timing)
                    outputs[name][i] = tokens
            print(f"{kind}: repeat {rep + 1}/{args.repeats} done", flush=True)
        rows: dict[str, Any] = {}
        for name in names:
            rows[name] = summarise([median_run(r) for r in runs[name]])
            if name in ours:
                drafts, drafted, accepted = (
                    a - b for a, b in zip(spec_counts(ours[name]), before[name], strict=True)
                )
                if drafted:
                    rows[name]["acceptance_rate"] = accepted / drafted
                    rows[name]["tokens_per_verification"] = 1 + accepted / drafts
                    rows[name]["draft_tokens"] = drafted
        for name, base in (("ours-ngram", "ours"), ("ours-draft", "ours"), ("ours", "hf"),
                           ("ours-ngram", "hf"), ("hf-prompt-lookup", "hf"),
                           ("ours-ngram", "hf-prompt-lookup")):  # fmt: skip
            if name in rows and base in rows:
                key = f"vs_{base}"
                rows[name][key + "_tok_s"] = ratio(rows[name]["tok_s"], rows[base]["tok_s"])
                rows[name][key + "_tpot"] = ratio(rows[base]["tpot_ms"], rows[name]["tpot_ms"])
        report_kinds[kind] = {
            "prompts": [{"trajectory": n, "tokens": len(p)} for n, p in items],
            "rows": rows,
            "greedy_identical_to_ours": {
                n: sum(outputs[n][i] == outputs["ours"][i] for i in range(len(items)))
                for n in names
            },
        }
        print(json.dumps({kind: rows}), flush=True)
    return {
        "model": "SmolLM2-135M-Instruct (model store), float32",
        "settings": {
            "ours": "hybridllm cloud engine, no speculation, greedy, one request at a time",
            "ours-ngram": f"--speculative-method ngram --num-speculative-tokens {args.k} "
            f"(prompt lookup max {ngram_cfg.prompt_lookup_max}, min {ngram_cfg.prompt_lookup_min})",
            "ours-draft": f"--speculative-method draft --num-speculative-tokens {args.draft_k} "
            f"--speculative-draft-num-layers {args.draft_layers} (kinds: {args.draft_kinds})",
            "hf": f"transformers {__import__('transformers').__version__} generate, greedy, "
            "fp32, batch 1",
            "hf-prompt-lookup": f"generate(prompt_lookup_num_tokens={args.k}, "
            f"max_matching_ngram_size={args.hf_max_ngram}), greedy",
        },
        "kinds": report_kinds,
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Speculative decoding: n-gram and draft-model speculation vs none, vs HF prompt lookup",
        "",
        f"- machine: {report['machine']}",
        f"- command: `{report['command']}` (git {report['git']}, {report['elapsed_s']:.0f} s)",
        f"- model: {report['model']}; prompts from `../shared/traces/swe-agent` "
        f"({report['args']['prompts_per_kind']} per kind, at most "
        f"{report['args']['max_prompt_tokens']} tokens), {report['args']['output_len']} new "
        f"tokens each, greedy (`ignore_eos`), one request at a time, medians of "
        f"{report['args']['repeats']} repeats per prompt",
        "",
        "Settings of each contender:",
        "",
        *[f"- `{k}`: {v}" for k, v in report["settings"].items()],
        "",
        "tok/s is output tokens over end-to-end time (prefill included), summed over the "
        "prompts; TPOT is the median time per output token after the first; acceptance is "
        "accepted / proposed tokens; x columns are ratios against the named baseline (tok/s "
        "ratio; for TPOT baseline / contender, so > 1 is faster). Our engines serve every "
        "repeat, so from the second repeat on our prompts hit the prefix cache (TTFT, and "
        "so tok/s, favour ours against HF, which recomputes the prompt); TPOT and the "
        "ratios between our own contenders do not depend on it.",
        "",
    ]
    for kind, data in report["kinds"].items():
        lines += [
            f"## {kind} prompts ({', '.join(str(p['tokens']) for p in data['prompts'])} tokens)",
            "",
            "| contender | tok/s | TPOT ms | TTFT ms | acceptance | tokens/verification "
            "| x ours (tok/s, TPOT) | x hf (tok/s, TPOT) | x hf-prompt-lookup (tok/s, TPOT) "
            "| greedy = ours |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        n = len(data["prompts"])
        for name, row in data["rows"].items():

            def pair(base: str, row: dict[str, Any] = row) -> str:
                if f"vs_{base}_tok_s" not in row:
                    return ""
                return f"{row[f'vs_{base}_tok_s']:.2f}x, {row[f'vs_{base}_tpot']:.2f}x"

            acc = f"{row['acceptance_rate']:.1%}" if "acceptance_rate" in row else ""
            tpv = (
                f"{row['tokens_per_verification']:.2f}" if "tokens_per_verification" in row else ""
            )
            same = data["greedy_identical_to_ours"][name]
            lines.append(
                f"| {name} | {row['tok_s']:.1f} | {row['tpot_ms']:.1f} | {row['ttft_ms']:.0f} "
                f"| {acc} | {tpv} | {pair('ours')} | {pair('hf')} | {pair('hf-prompt-lookup')} "
                f"| {same}/{n} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="HF-layout dir (default: the store's SmolLM2)")
    ap.add_argument(
        "--traces", default=str(TRACES / "swe-agent"), help="folder of SWE-agent *.traj files"
    )
    ap.add_argument("--prompts-per-kind", type=int, default=3)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--system-chars", type=int, default=1500)
    ap.add_argument("--code-lines", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="n-gram: proposed tokens per step")
    ap.add_argument("--hf-max-ngram", type=int, default=4, help="HF max_matching_ngram_size")
    ap.add_argument("--draft-layers", type=int, default=20, help="0: no draft contender")
    ap.add_argument("--draft-k", type=int, default=3)
    ap.add_argument("--draft-kinds", default="code", help="prompt kinds the draft runs on")
    ap.add_argument("--kv-blocks", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every contender")
    ap.add_argument("--out", default=str(RESULTS / "speculative"))
    ap.add_argument("--render-only", action="store_true", help="rewrite .md from .json")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render_only:
        out.with_suffix(".md").write_text(
            render_markdown(json.loads(out.with_suffix(".json").read_text()))
        )
        return 0
    import torch
    from cloud.run import machine

    torch.set_num_threads(args.threads)
    gpu = "no GPU" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    t0 = time.time()
    report: dict[str, Any] = {
        "machine": f"{machine()}, {gpu}",
        "command": " ".join(["uv run python bench/speculative/run.py", *sys.argv[1:]]),
        "git": git_head(),
        "args": vars(args) | {k: os.path.relpath(getattr(args, k), ROOT) for k in ("traces", "out")},
    }  # fmt: skip
    report |= run(args)
    report["elapsed_s"] = time.time() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render_markdown(report))
    print(f"wrote {out}.json / .md in {report['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
