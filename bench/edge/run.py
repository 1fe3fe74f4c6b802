"""Edge runtime benchmark: our server vs llama-cpp-python in-process and vs its own server.

One command (from the repository root)::

    uv run --no-sync python bench/edge/run.py --out bench/results/edge

Peers, measured in the same run on the same GGUF (the shipped SmolLM2-135M Q4_1), with the
same number of CPU threads:

1. single stream: decode tokens/s of ``llama_cpp.Llama`` in-process vs ``hybridllm-edge
   serve`` over HTTP (streamed; time between the first and the last token);
2. 1, 4, 8 concurrent clients: aggregate output tokens/s and p95 request latency of our
   server (``--parallel 8``, batched slots) vs ``python -m llama_cpp.server``;
3. response cache: end-to-end latency of a repeated greedy question over loopback with the
   ``openai`` client, and the client's own share (``bench/edge/cache_hit.py``).

``--weights`` picks the GGUF both servers load (default the shipped Q4_1; ``q8_0``,
``q4_0``, ``f16``: see ``bench/edge/weights.py`` and ``bench/edge/scaling.py`` for why the
weight type decides how much batching can gain on a CPU). ``--ours-weights`` gives our
server another file than the peer's (each server on the weights it serves fastest: a
one-at-a-time server wants the fastest batch-1 kernel, a batched one the kernel that
batches); the single-stream comparison then uses our file on both sides.

``llama_cpp.server`` needs the ``server`` extra's packages that the workspace does not lock
(sse-starlette, starlette-context); ``--peer-deps`` points at a folder holding them
(``uv pip install --no-deps --target .bench-deps/llama_server sse-starlette
"starlette-context<0.4"``), put on the peer's PYTHONPATH only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cache_hit
import weights
from portable import portable

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "Write a long story about a dragon who learns to cook:\n",
    "Explain in detail how a bicycle works:\n",
    "Write a letter to a friend about your summer holidays:\n",
    "Describe the history of the Roman empire:\n",
    "List ten tips for learning a new language, with explanations:\n",
    "Write a poem about the ocean at night:\n",
    "Describe a day in the life of a farmer:\n",
    "Explain why the sky is blue to a child:\n",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(
            line for line in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in line
        )
        ram_gib = int(mem.split()[1]) / (1 << 20)
    except OSError:
        ram_gib = 0.0
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(ram_gib, 1),
        "load": os.getloadavg(),
    }


def start(cmd: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log_path = Path(f"/tmp/bench-edge-{port}.log")  # a pipe would fill up and block the server
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[:4]} did not come up: {log_path.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream_completion(base: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streamed /v1/completions request: latency, token count, decode tokens/s."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"x-hybridllm-cache": "bypass"}
    times: list[float] = []
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body, headers=headers, timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    end = time.perf_counter()
    n = len(times)
    decode = (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0
    return {
        "latency": end - t0,
        "tokens": n,
        "decode_tps": decode,
        "ttft": times[0] - t0 if n else 0.0,
    }


def completion(base: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One non-streamed /v1/completions request (the peer's SSE needs an older sse-starlette)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(
        f"{base}/v1/completions", json=body, headers={"x-hybridllm-cache": "bypass"}, timeout=600
    )
    r.raise_for_status()
    return {"latency": time.perf_counter() - t0, "tokens": r.json()["usage"]["completion_tokens"]}


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def in_process_decode(llm: Any, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s of llama-cpp-python in-process, streamed, first to last token."""
    times = []
    for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, stream=True):
        if chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def load_test(
    base: str, clients: int, per_client: int, max_tokens: int, lengths: list[int] | None = None
) -> dict[str, float]:
    """Closed loop; with ``lengths`` client c's request i asks ``lengths[(3c + i) % len]`` tokens."""

    def client(c: int) -> list[dict[str, float]]:
        return [
            completion(base, PROMPTS[(c + i) % len(PROMPTS)],
                       lengths[(3 * c + i) % len(lengths)] if lengths else max_tokens)
            for i in range(per_client)
        ]  # fmt: skip

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "output_tokens": sum(r["tokens"] for r in results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "p95_latency_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
        "median_latency_s": statistics.median(lat),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="default bench/results/edge[-WEIGHTS]")
    parser.add_argument("--weights", choices=weights.CHOICES, default="q4_1",
                        help="GGUF both servers load (bench/edge/weights.py)")  # fmt: skip
    parser.add_argument("--ours-weights", choices=weights.CHOICES,
                        help="another GGUF for our server (default: --weights)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating ours/peer rounds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--peer-deps", default=".bench-deps/llama_server")
    parser.add_argument("--lengths", type=int, nargs="+",
                        help="mixed max_tokens per request in the load tests")  # fmt: skip
    args = parser.parse_args()

    if args.out is None:
        suffix = "" if args.weights == "q4_1" else f"-{args.weights}"
        if args.ours_weights and args.ours_weights != args.weights:
            suffix += f"-ours-{args.ours_weights}"
        if args.lengths:
            suffix += "-mixed"
        args.out = ROOT / f"bench/results/edge{suffix}"
    gguf = peer_gguf = str(weights.resolve(args.weights))
    label = args.weights.upper()
    if args.ours_weights and args.ours_weights != args.weights:
        gguf = str(weights.resolve(args.ours_weights))
        label = f"{args.ours_weights.upper()} (ours) vs {label} (peer)"
    report: dict[str, Any] = {"machine": machine(), "command": portable(" ".join(sys.argv)),
                              "gguf": portable(gguf), "peer_gguf": portable(peer_gguf), "weights": label, "threads": args.threads,
                              "max_tokens": args.max_tokens, "lengths": args.lengths,
                              "per_client": args.per_client}  # fmt: skip

    ours_port, peer_port = free_port(), free_port()
    ours_cmd = [sys.executable, "-m", "hybridllm_edge.cli", "serve", "--model", gguf, "--parallel", "8",
                "--threads", str(args.threads), "--max-model-len", "1024", "--port", str(ours_port),
                "--host", "127.0.0.1"]  # fmt: skip
    peer_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", peer_gguf, "--n_ctx", "2048",
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                "--port", str(peer_port), "--host", "127.0.0.1"]  # fmt: skip
    peer_env = {**os.environ, "PYTHONPATH": args.peer_deps}
    report["ours_command"] = portable(" ".join(ours_cmd))
    report["peer_command"] = portable(" ".join(peer_cmd))

    # Both servers stay up (an idle server costs no CPU) and every measurement alternates
    # ours / peer, so a burst of load on this shared machine hits both alike.
    from llama_cpp import Llama

    llm = Llama(
        gguf, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
    )
    ours = start(ours_cmd, ours_port)
    peer = start(peer_cmd, peer_port, peer_env)
    ours_base, peer_base = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{peer_port}"
    try:
        stream_completion(ours_base, PROMPTS[0], 4)  # warm up
        completion(peer_base, PROMPTS[0], 4)
        raw, served = [], []
        for i in range(args.repeats):
            print(f"single stream {i}", flush=True)
            raw.append(in_process_decode(llm, PROMPTS[i % 8], args.max_tokens))
            served.append(
                stream_completion(ours_base, PROMPTS[i % 8], args.max_tokens)["decode_tps"]
            )
        del llm
        rounds: dict[int, list[tuple[dict[str, float], dict[str, float]]]] = {}
        for r in range(args.rounds):
            for c in args.concurrency:
                print(f"round {r}: {c} clients", flush=True)
                o = load_test(ours_base, c, args.per_client, args.max_tokens, args.lengths)
                p = load_test(peer_base, c, args.per_client, args.max_tokens, args.lengths)
                rounds.setdefault(c, []).append((o, p))
        print("cache", flush=True)
        report["cache"] = cache_hit.measure(ours_base, ours_port, free_port(), 200)
    finally:
        stop(ours)
        stop(peer)

    report["load_end"] = list(os.getloadavg())
    report["single_stream"] = {
        "in_process_decode_tps": raw, "ours_decode_tps": served,
        "ratio_median": statistics.median(o / r for o, r in zip(served, raw, strict=True)),
    }  # fmt: skip
    report["rounds"] = args.rounds
    report["concurrency"] = [
        {"clients": c, "ours": _median_run([o for o, _ in runs]),
         "llama_cpp_server": _median_run([p for _, p in runs]),
         "throughput_ratio": statistics.median(o["tokens_per_s"] / p["tokens_per_s"] for o, p in runs),
         "p95_ratio": statistics.median(o["p95_latency_s"] / p["p95_latency_s"] for o, p in runs),
         "runs": [{"ours": o, "llama_cpp_server": p} for o, p in runs]}
        for c, runs in rounds.items()
    ]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    from plot import plot, write_markdown  # bench/edge/plot.py, beside this file

    plot(report, Path(f"{args.out}.png"))
    write_markdown(report, Path(f"{args.out}.md"))
    print(Path(f"{args.out}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
