"""Verifier-guided step search against plain sampling at equal compute, on a task set with
checkable answers.

    uv run python bench/search/verifier.py [--problems 30] [--seeds 3] [--configs 2x2 4x2 8x2]

The task set is generated here (``--problems`` two-step problems ``a + b - c`` with
single-digit operands, seed 0): each is a four-shot prompt whose examples solve one step
per line and end with ``Answer: N``, which SmolLM2-135M-Instruct follows; the answer is
checked exactly. Every contender runs on the same engine and model (fp32, one process,
two torch threads), all problems side by side (as concurrent requests would):

- **greedy**: one greedy solution (a reference, not at equal compute);
- **sampling**: single samples at the search's temperature (the mean accuracy of one sample);
- **majority vote** (self-consistency): samples of the same problem, taken in order while
  their compute fits the search's compute on that problem, and the most frequent answer;
- **best-of-N, verifier**: the same samples, the one the verifier scores best (the mean
  log-likelihood of the whole solution under the model, from the logprobs its sampling
  computed: what the OpenAI API's ``best_of`` does), its answer;
- **step search**: ours (``hybridllm_cloud.search.step_search``), for each of
  ``--configs`` (K candidates per path and round, beam width B), one step per line, the
  model verifying its own steps (mean log-likelihood of a step, from the logprobs its
  sampling computed), in the same engine and KV cache. Each configuration sets its own
  budget, so the sampling contenders are compared with it at each.

Compute is tokens computed by the model: prompt tokens not served by the prefix cache
plus generated tokens, for generation and scoring alike (``step_search.Compute``). Each
problem's sample pool is drawn once per seed (its first sample before the others, so that
they find the prompt in the prefix cache, as the search's first round does); the pools are
drawn after the searches, so their prompts' last blocks may already be cached, which
favours sampling by at most one block per problem. Accuracy is
reported per seed and as the median over ``--seeds``; one sample pool per seed serves every
configuration. Writes
bench/results/search-verifier.md and .json (machine, command, settings).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.search import step_search

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portable import git_head, model_path, portable, torch_machine_line

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

SHOTS = (
    "Q: 3 + 4 - 2 = ?\nA: 3 + 4 = 7\n7 - 2 = 5\nAnswer: 5\n\n"
    "Q: 6 + 2 - 1 = ?\nA: 6 + 2 = 8\n8 - 1 = 7\nAnswer: 7\n\n"
    "Q: 5 + 5 - 3 = ?\nA: 5 + 5 = 10\n10 - 3 = 7\nAnswer: 7\n\n"
    "Q: 9 + 4 - 6 = ?\nA: 9 + 4 = 13\n13 - 6 = 7\nAnswer: 7\n\n"
)
END = "\n\n"
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def tasks(n: int) -> list[tuple[str, int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        out.append((SHOTS + f"Q: {a} + {b} - {c} = ?\nA:", a + b - c))
    return out


def answer(text: str) -> int | None:
    m = ANSWER.search(text)
    return int(m.group(1)) if m else None


def cut(text: str) -> str:
    return text.split(END, 1)[0]


def sample_pools(
    engine: llm_engine.LLMEngine, prompts: list[list[int]], size: int, seed: int,
    args: argparse.Namespace,
) -> list[list[dict[str, Any]]]:  # fmt: skip
    """``size`` samples per prompt, in order, each with its compute and its verifier score:
    the mean log-likelihood of the solution under the model, read from the logprobs its
    sampling computed (the model is the verifier, as in the search; no extra compute). The
    first sample of every prompt runs first, so that the others find their prompt in the
    prefix cache."""

    def params(p: int, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              seed=seed * 100_000 + p * 100 + i, stop=(END,), logprobs=0)  # fmt: skip

    first = engine.generate(prompts, [params(p, 0) for p in range(len(prompts))])
    rest_keys = [(p, i) for p in range(len(prompts)) for i in range(1, size)]
    rest = engine.generate([prompts[p] for p, _ in rest_keys], [params(p, i) for p, i in rest_keys])
    outs = {(p, 0): o for p, o in enumerate(first)} | dict(zip(rest_keys, rest, strict=True))
    pools: list[list[dict[str, Any]]] = [[] for _ in prompts]
    for p, i in sorted(outs):
        out = outs[p, i]
        lps = out.logprobs or []
        pools[p].append({
            "answer": answer(cut(out.text)),
            "compute": step_search.computed_tokens(out),
            "score": sum(lp.logprob for lp in lps) / max(len(lps), 1),
        })  # fmt: skip
    return pools


def within(pool: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The pool's first samples whose compute fits ``budget`` (at least one)."""
    taken, spent = [], 0
    for s in pool:
        cost = s["compute"]
        if taken and spent + cost > budget:
            break
        taken.append(s)
        spent += cost
    return taken


def vote(samples: list[dict[str, Any]]) -> int | None:
    answers = [s["answer"] for s in samples if s["answer"] is not None]
    if not answers:
        return None
    counts = collections.Counter(answers)
    best = max(counts.values())
    return next(a for a in answers if counts[a] == best)  # ties: the earliest sample's


def run_config(
    engine: llm_engine.LLMEngine, items: list[tuple[list[int], str, int]], seed: int,
    config: tuple[int, int], pools: list[list[dict[str, Any]]], args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One search configuration (K candidates, beam B) and the sampling contenders at its
    compute, problem by problem."""
    k, b = config
    params = step_search.StepSearchParams(
        num_candidates=k, beam_width=b, max_steps=args.max_steps, max_step_tokens=args.max_tokens,
        max_tokens=args.max_tokens, step_delimiters=("\n",), stop=(END,),
        temperature=args.temperature,
    )  # fmt: skip
    t0 = time.perf_counter()
    results = step_search.run_offline_batch(
        [step_search.Problem(prompt, text, text) for prompt, text, _ in items],
        [dataclasses.replace(params, seed=seed * 100_000 + i * 1000) for i in range(len(items))],
        engine,
    )
    seconds = time.perf_counter() - t0
    rows = []
    for (_, _, truth), result, pool in zip(items, results, pools, strict=True):
        budget = result.compute.total_tokens
        taken = within(pool, budget)
        rows.append({
            "search": answer(result.texts[0]) == truth,
            "search_compute": budget,
            "search_verifier": result.compute.verifier_tokens,
            "vote": vote(taken) == truth,
            "verifier": max(taken, key=lambda s: s["score"])["answer"] == truth,
            "samples": len(taken),
            "sample_compute": sum(s["compute"] for s in taken),
            "pool_exhausted": len(taken) == len(pool),
        })  # fmt: skip
    n = len(rows)
    print(f"  seed {seed}, search {k}x{b}: {sum(r['search'] for r in rows)}/{n} right, "
          f"majority vote {sum(r['vote'] for r in rows)}/{n} ({seconds:.0f} s)",
          file=sys.stderr, flush=True)  # fmt: skip
    return {
        "accuracy": {
            "step search": sum(r["search"] for r in rows) / n,
            "majority vote": sum(r["vote"] for r in rows) / n,
            "best-of-N, verifier": sum(r["verifier"] for r in rows) / n,
        },
        "search_tokens_per_problem": statistics.mean(r["search_compute"] for r in rows),
        "search_verifier_tokens_per_problem": statistics.mean(r["search_verifier"] for r in rows),
        "sampling_tokens_per_problem": statistics.mean(r["sample_compute"] for r in rows),
        "samples_per_problem": statistics.mean(r["samples"] for r in rows),
        "pool_exhausted": sum(r["pool_exhausted"] for r in rows),
        "search_seconds": seconds,
    }


def run_seed(
    engine: llm_engine.LLMEngine, items: list[tuple[list[int], str, int]], seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    t0 = time.perf_counter()
    pools = sample_pools(engine, [prompt for prompt, _, _ in items], args.pool, seed, args)
    pool_seconds = time.perf_counter() - t0
    return {
        "seed": seed,
        "sampling_accuracy": statistics.mean(
            statistics.mean(s["answer"] == truth for s in pool)
            for (_, _, truth), pool in zip(items, pools, strict=True)
        ),
        "sample_tokens": statistics.mean(s["compute"] for pool in pools for s in pool[1:]),
        "pool_seconds": pool_seconds,
        "configs": {
            f"{k}x{b}": run_config(engine, items, seed, (k, b), pools, args)
            for k, b in args.configs
        },
    }


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    runs = report["runs"]
    contenders = ["step search", "majority vote", "best-of-N, verifier"]

    def med(f: Any) -> float:
        return float(statistics.median(f(r) for r in runs))

    def cfg(name: str, *keys: str) -> float:
        """The median over seeds of ``runs[i]["configs"][name][keys...]``."""
        values = []
        for r in runs:
            v = r["configs"][name]
            for key in keys:
                v = v[key]
            values.append(v)
        return float(statistics.median(values))

    lines = [
        "# Verifier-guided step search against plain sampling at equal compute",
        "",
        f"- machine: {report['machine']}",
        f"- commit: {report['commit']}",
        f"- command: `{report['command']}`",
        f"- model: SmolLM2-135M-Instruct, fp32, one engine (block {s['block_size']}, prefix "
        "caching on), every contender on it, all problems side by side",
        f"- task set: {s['problems']} problems `a + b - c` (single digits, seed 0), four-shot, "
        "one step per line, `Answer: N` checked exactly",
        "- step search (`hybridllm_cloud.search.step_search`): K candidates per path and round, "
        f"beam width B, at most {s['max_steps']} steps and {s['max_tokens']} tokens, "
        f"temperature {s['temperature']}; the model verifies its own steps (mean "
        "log-likelihood of a step, read from the logprobs its sampling computed; a path's "
        "score is the mean over its steps)",
        f"- sampling: temperature {s['temperature']}, a pool of {s['pool']} samples per problem "
        "and seed; majority vote (self-consistency) and best-of-N take the pool's first "
        "samples whose compute fits the search's on the same problem; best-of-N returns the "
        "one with the best mean log-likelihood (the same verifier's score, from the "
        "sampling's logprobs: what the OpenAI API's `best_of` does)",
        "- compute: tokens the model computed (prompt tokens not served by the prefix cache, "
        "plus generated), generation and verification together",
        f"- seeds: {', '.join(str(r['seed']) for r in runs)}; medians over them; greedy is one run",
        "",
        "## Accuracy at equal compute",
        "",
        "| search K x B | tokens per problem | step search | majority vote | best-of-N, "
        "verifier | samples that fit | per seed (search / vote / best-of-N) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in runs[0]["configs"]:
        per_seed = "; ".join(
            " / ".join(f"{r['configs'][name]['accuracy'][c]:.0%}" for c in contenders) for r in runs
        )
        lines.append(
            f"| {name} | {cfg(name, 'search_tokens_per_problem'):.0f} | "
            + " | ".join(f"{cfg(name, 'accuracy', c):.1%}" for c in contenders)
            + f" | {cfg(name, 'samples_per_problem'):.1f} | {per_seed} |"
        )
    g = report["greedy"]
    lines += [
        "",
        f"One sample at temperature {s['temperature']}: {med(lambda r: r['sampling_accuracy']):.1%} "
        f"({med(lambda r: r['sample_tokens']):.0f} tokens); greedy: {g['accuracy']:.1%} "
        f"({g['compute_per_problem']:.0f} tokens, the prompt's uncached tail included).",
        "",
        "## Verdict",
        "",
    ]
    for name in runs[0]["configs"]:
        search = cfg(name, "accuracy", "step search")
        best = max(contenders[1:], key=lambda c, n=name: cfg(n, "accuracy", c))
        other = cfg(name, "accuracy", best)
        lines.append(f"- {name}: step search {search:.1%} against {best} {other:.1%}, "
                     f"**{(search - other) * 100:+.1f} points** at equal compute")  # fmt: skip
    lines += [
        "",
        "## Time and pools",
        "",
        "| seed | sample pools s | "
        + " | ".join(f"search {n} s" for n in runs[0]["configs"])
        + " | problems whose pool ran out |",
        "|---:|---:|" + "---:|" * len(runs[0]["configs"]) + "---:|",
    ]
    for r in runs:
        exhausted = max(c["pool_exhausted"] for c in r["configs"].values())
        lines.append(f"| {r['seed']} | {r['pool_seconds']:.0f} | "
                     + " | ".join(f"{c['search_seconds']:.0f}" for c in r["configs"].values())
                     + f" | {exhausted} |")  # fmt: skip
    lines += [
        "",
        "A pool that ran out means the sampling contenders had budget left over (raise `--pool`).",
        "",
    ]
    return "\n".join(lines)


def config(text: str) -> tuple[int, int]:
    k, _, b = text.partition("x")
    if not (k.isdigit() and b.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: want KxB, e.g. 4x2")
    return int(k), int(b)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF-layout directory (default: the model store's)"
    )
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--configs",
        type=config,
        nargs="+",
        default=[(2, 2), (4, 2), (8, 2)],
        help="search configurations KxB: K candidates per path and round, beam width B",
    )
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--pool", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "search-verifier"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = llm_engine.LLMEngine.from_path(
        model_path(args.model),
        llm_engine.EngineConfig(num_kv_blocks=1024, block_size=16, max_model_len=1024),
    )
    assert engine.tokenizer is not None
    items = [(engine.tokenizer.encode(text), text, truth) for text, truth in tasks(args.problems)]
    greedy = engine.generate([p for p, _, _ in items],
                             SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=(END,)))  # fmt: skip
    report: dict[str, Any] = {
        "machine": torch_machine_line(),
        "commit": git_head(),
        "command": portable(" ".join(["uv run python bench/search/verifier.py", *sys.argv[1:]])),
        "settings": {
            "problems": args.problems,
            "configs": [f"{k}x{b}" for k, b in args.configs],
            "max_steps": args.max_steps,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "pool": args.pool,
            "block_size": 16,
            "threads": args.threads,
        },
        "greedy": {
            "accuracy": sum(
                answer(cut(o.text)) == t for o, (_, _, t) in zip(greedy, items, strict=True)
            )
            / len(items),
            "compute_per_problem": statistics.mean(step_search.computed_tokens(o) for o in greedy),
        },
        "runs": [],
    }
    for seed in range(args.seeds):
        report["runs"].append(run_seed(engine, items, seed, args))
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
