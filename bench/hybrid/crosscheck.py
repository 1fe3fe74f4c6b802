"""Our session replay against guidellm on one request-level load: do they measure the same?

    uv run python bench/hybrid/crosscheck.py --guidellm PATH/TO/guidellm [--requests 48]

The hybrid harness drives its load with its own session generator (``sessions.py``). To
check that generator once against an established one, both run the same plain
request-level load, one after the other, against the same ``monolithic`` service in local
mode (``hybridllm up``: the real gateway and the cloud runtime, two cores):

- **guidellm** (``guidellm run``, its ``openai_http`` backend on the chat endpoint,
  ``concurrent`` profile with ``--concurrency`` streams, ``synthetic_text`` prompts of
  ``--prompt-tokens`` tokens counted with the served model's own tokenizer, outputs of
  ``--output-tokens``, ``--requests`` requests);
- **ours**: ``--requests`` one-call sessions, ``--concurrency`` in flight, each a chat
  prompt of the same token count (words from the SWE-agent trajectories, trimmed with
  the same tokenizer) asking for the same number of tokens with ``ignore_eos``, streamed
  through the ``openai`` client so that time to first token is measured the same way.

Ours runs before and after guidellm, so that an order effect shows. Reported side by
side: requests/s, output tokens/s, request latency p50/p95, time to first token p50/p95,
the load generator's own CPU seconds (both share the machine with the service), and the
ratios ours / guidellm. guidellm runs from its own
virtual environment (``--guidellm``; it is not a dependency of this project:
``uv venv ~/.cache/hybridllm/bench/guidellm-venv && uv pip install guidellm``).
Writes bench/results/hybrid-crosscheck.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import run as run_mod
import sessions as sessions_mod
from portable import free_port, git_head, machine_line, model_path, portable

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def prompts(tokenizer: Any, n: int, tokens: int) -> list[str]:
    """``n`` distinct prompts of exactly ``tokens`` tokens (as the served model counts them)."""
    words = sessions_mod.trace_words()
    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(tokens * 2)),
                               add_special_tokens=False)[:tokens]  # fmt: skip
        out.append(tokenizer.decode(ids))
    return out


async def ours(url: str, texts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    latencies: list[float] = []
    ttfts: list[float] = []
    tokens = 0
    queue = list(texts)

    async def one(text: str) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        first = None
        n = 0
        stream = await client.chat.completions.create(
            model=run_mod.SERVED, messages=[{"role": "user", "content": text}],
            max_tokens=args.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        latencies.append(time.perf_counter() - t0)
        ttfts.append(first if first is not None else latencies[-1])
        tokens += n

    async def lane() -> None:
        while queue:
            await one(queue.pop())

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    return summary(latencies, ttfts, tokens, wall)


def summary(latencies: list[float], ttfts: list[float], tokens: int, wall: float) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / wall,
        "output_tokens_per_s": tokens / wall,
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": run_mod.pct(latencies, 0.95),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": run_mod.pct(ttfts, 0.95),
    }


def guidellm(url: str, tokenizer_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model={run_mod.SERVED}",
        "--profile", f"kind=concurrent,streams={args.concurrency}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                  f"output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    report = json.loads(out.read_text())
    return {"raw": report, "cmd": cmd, "summary": guidellm_summary(report)}


def guidellm_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The numbers of guidellm's one benchmark, read from its per-request records
    (``request_latency``, ``time_to_first_token_ms``, ``output_tokens``, start and end)."""
    bench = report["benchmarks"][0]
    reqs = bench["requests"]["successful"]
    lat = [r["request_latency"] for r in reqs]
    ttft = [r["time_to_first_token_ms"] / 1000.0 for r in reqs]
    tokens = sum(r.get("output_tokens") or 0 for r in reqs)
    wall = max(r["request_end_time"] for r in reqs) - min(r["request_start_time"] for r in reqs)
    return summary(lat, ttft, tokens, wall)


def render(r: dict[str, Any]) -> str:
    g, o, before = r["guidellm"], r["ours"], r["ours_before"]
    rows = [
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
        ("request latency p50 (s)", "latency_p50_s", "{:.2f}"),
        ("request latency p95 (s)", "latency_p95_s", "{:.2f}"),
        ("time to first token p50 (s)", "ttft_p50_s", "{:.2f}"),
        ("time to first token p95 (s)", "ttft_p95_s", "{:.2f}"),
        ("load generator's CPU (s)", "client_cpu_s", "{:.1f}"),
    ]
    a = r["settings"]
    lines = [
        "# Our session replay against guidellm, one request-level load",
        "",
        f"- machine: {r['machine']}",
        f"- commit: {r['commit']}",
        f"- command: `{r['command']}`",
        "- target: the `monolithic` LLMService in local mode (the real gateway and cloud "
        "runtime, SmolLM2-135M-Instruct fp32, two cores)",
        f"- load: {a['requests']} chat requests, {a['concurrency']} in flight, prompts of "
        f"{a['prompt_tokens']} tokens, {a['output_tokens']} output tokens each (ignore_eos), "
        "streamed; ours, then guidellm, then ours again, on the same warm service (the ratio "
        "is against our second run; the first shows what order changes)",
        f"- guidellm {r['guidellm_version']}: `{' '.join(r['guidellm_cmd'])}`",
        "",
        "| | ours, first | guidellm | ours, after | ours after / guidellm |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt.format(before[key])} | {fmt.format(g[key])} | "
                     f"{fmt.format(o[key])} | {o[key] / g[key]:.2f}x |")  # fmt: skip
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--guidellm", required=True, help="the guidellm executable (its own venv)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "hybrid-crosscheck"))
    args = ap.parse_args(argv)
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True).stdout
    from hybridllm_cloud import tokenizer as tokenizer_mod

    tok_dir = model_path(None)
    tok = tokenizer_mod.Tokenizer(tok_dir)
    texts = prompts(tok, args.requests, args.prompt_tokens)
    margs = argparse.Namespace(context_length=2048, edge_quantization="q4_k_m",
                               edge_max_prompt_tokens=1024, cascade_min_mean_logprob=-1.5)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="hybrid-crosscheck-"))
    path = work / "monolithic.yaml"
    path.write_text(yaml.safe_dump(run_mod.manifest("monolithic", margs)))
    state_root = work / "state"
    port = free_port()
    up = run_mod.hybridllm("up", "-d", "-f", str(path), "--port", str(port), "--state-root",
                           str(state_root), "--wait-timeout", "900")  # fmt: skip
    if up.returncode != 0:
        raise SystemExit(f"hybridllm up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
    url = f"http://127.0.0.1:{port}/v1"
    try:
        asyncio.run(
            ours(url, texts[:2], argparse.Namespace(**{**vars(args), "concurrency": 1}))
        )  # warm
        # ours, guidellm, ours again: an order effect (a warmer service, the machine) shows
        # as a difference between our two runs
        c0 = time.process_time()
        o1 = asyncio.run(ours(url, texts, args))
        o1["client_cpu_s"] = time.process_time() - c0
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        g = guidellm(f"http://127.0.0.1:{port}", tok_dir, work / "guidellm.json", args)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        g["summary"]["client_cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
        c0 = time.process_time()
        o2 = asyncio.run(ours(url, texts, args))
        o2["client_cpu_s"] = time.process_time() - c0
    finally:
        run_mod.hybridllm("down", "bench-monolithic", "--state-root", str(state_root), timeout=300)
        shutil.rmtree(work, ignore_errors=True)
    given = argv if argv is not None else sys.argv[1:]
    rest = [
        a
        for i, a in enumerate(given)
        if a != "--guidellm" and (i == 0 or given[i - 1] != "--guidellm")
    ]
    report = {
        "machine": machine_line(),
        "commit": git_head(),
        "command": " ".join(
            ["uv run python bench/hybrid/crosscheck.py --guidellm PATH/TO/guidellm", *rest]
        ),
        "settings": {k: v for k, v in vars(args).items() if k not in ("guidellm", "out")},
        "guidellm_version": version.strip().split()[-1] if version.strip() else "?",
        "guidellm_cmd": [
            portable(c).replace(args.guidellm, "guidellm").replace(str(work) + "/", "")
            for c in g["cmd"]
        ],
        "guidellm": g["summary"],
        "ours_before": o1,
        "ours": o2,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
