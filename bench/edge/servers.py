"""The edge runtime against llama.cpp's own server, llama-server, and llama-cpp-python's.

One command (from the repository root)::

    uv run --no-sync python bench/edge/servers.py [--weights q4_k_m]
    # writes bench/results/edge-servers[-WEIGHTS].{md,json}

Three servers on the same GGUF, the same CPU threads and the same slots, measured in the
same run, every measurement alternating between them (all stay up; an idle server costs
no CPU):

- **ours**: ``hybridllm-edge serve --parallel 8`` (batched slots);
- **llama-server**: llama.cpp's own server, built by ``bench/edge/build-llama-server.sh``
  from the llama.cpp that the locked llama-cpp-python vendors (the same commit: the same
  kernels as ours), run as its README says for serving several clients: ``-np 8`` parallel
  slots, continuous batching (``-cb``), the prompt cache (on by default), a context of
  8 x 1024 so that each slot holds what one of ours does;
- **llama_cpp.server**: ``python -m llama_cpp.server``, the Python peer (one request at a
  time); its SSE needs packages the workspace does not lock, so it is asked non-streamed
  (no time to first token), with ``--peer-deps`` as in bench/edge/run.py.

Measured: single stream (decode tokens/s between the first and the last streamed token,
and llama-cpp-python in-process, streamed and not, to say what the in-process baseline
measures); 1, 4, 8 and 16 concurrent clients (aggregate output tokens/s, p50 / p95
latency, p50 / p95 time to first token), each client sending its requests one after
another; and an agentic load: every request carries the same long system prompt (an
agent's instructions and tool list) and its own short task, which a prompt cache can
reuse. Medians over ``--rounds`` rounds. Requests ask greedy decoding of ``--max-tokens``
tokens; tokens are the servers' own usage counts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import weights  # noqa: E402
from portable import portable  # noqa: E402
from run import PROMPTS, free_port, machine, start, stop  # noqa: E402

ROOT = HERE.parents[1]
SLOTS = 8
CONTEXT = 1024  # per slot
SYSTEM = (
    "You are a coding agent working in a Python repository. You solve the user's task by "
    "calling tools, one call per turn, and you answer with exactly one JSON object of the "
    'form {"tool": NAME, "arguments": {...}} and nothing else. Think about which file '
    "to read before you edit it, keep every edit small, run the tests after each edit, and "
    "stop when they pass. Never invent a file path: list the directory first.\n\n"
    "Tools:\n"
    "- list_dir(path): the entries of a directory, one per line, folders ending in '/'.\n"
    "- read_file(path, start, end): the lines start to end of a file, numbered.\n"
    "- search(pattern, path): every line under path that matches a regular expression, "
    "with its file and line number.\n"
    "- edit_file(path, start, end, text): replace the lines start to end with text; "
    "returns the new lines around the edit.\n"
    "- run_tests(selector): run pytest on a file, a test or a folder; returns the summary "
    "and the first failure.\n"
    "- finish(summary): end the task with a one-paragraph summary of what changed.\n\n"
    "Rules: a path is relative to the repository root. A failed tool call returns an error "
    "message; read it and try again differently. Do not repeat a call that failed the same "
    "way twice. Do not edit tests unless the task says so."
)
TASKS = [
    "The function parse_date in utils/dates.py fails on ISO dates with a timezone. Fix it.",
    "Add a --verbose flag to the command line in cli/main.py that prints each step.",
    "The test tests/test_cache.py::test_expiry is flaky. Find out why.",
    "Rename the class Config to Settings everywhere in the package.",
    "The endpoint /users returns 500 when the name is empty. Return 400 instead.",
    "Make the retry loop in net/client.py back off exponentially, capped at 30 seconds.",
    "Remove the unused imports in the models folder.",
    "Add a docstring to every public function in api/routes.py.",
]


def stream(base: str, path: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed request: latency, time to the first token, decode tokens/s (first to
    last token), and the completion tokens of the server's usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    usage = None
    t0 = time.perf_counter()
    with httpx.stream(
        "POST", base + path, json=body, headers={"x-hybridllm-cache": "bypass"}, timeout=900
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    arrivals.append(time.perf_counter())
    end = time.perf_counter()
    n = len(arrivals)
    return {
        "latency": end - t0,
        "ttft": arrivals[0] - t0 if n else end - t0,
        "tokens": float(usage if usage is not None else n),
        "decode_tps": (n - 1) / (arrivals[-1] - arrivals[0]) if n > 1 else 0.0,
    }


def unstreamed(base: str, path: str, body: dict[str, Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    r = httpx.post(base + path, json=body, headers={"x-hybridllm-cache": "bypass"}, timeout=900)
    r.raise_for_status()
    return {
        "latency": time.perf_counter() - t0,
        "tokens": float(r.json()["usage"]["completion_tokens"]),
    }


class Server:
    def __init__(
        self, name: str, cmd: list[str], port: int, streams: bool, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.cmd, self.port, self.streams, self.env = name, cmd, port, streams, env
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def ask(self, path: str, body: dict[str, Any]) -> dict[str, float]:
        return (stream if self.streams else unstreamed)(self.base, path, body)


def request_body(kind: str, i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if kind == "agentic":
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TASKS[i % len(TASKS)]},
        ]
        return "/v1/chat/completions", {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    return "/v1/completions", {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def load(
    server: Server, kind: str, clients: int, per_client: int, max_tokens: int
) -> dict[str, Any]:
    """Closed loop: ``clients`` clients, each sending ``per_client`` requests in turn."""

    def client(c: int) -> list[dict[str, float]]:
        return [
            server.ask(*request_body(kind, c * per_client + i, max_tokens))
            for i in range(per_client)
        ]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0

    def pct(key: str, q: float) -> float | None:
        values = sorted(r[key] for r in results if key in r)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None

    return {
        "requests": len(results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "p50_latency_s": pct("latency", 0.5),
        "p95_latency_s": pct("latency", 0.95),
        "p50_ttft_s": pct("ttft", 0.5),
        "p95_ttft_s": pct("ttft", 0.95),
    }


def in_process(gguf: str, threads: int, max_tokens: int, repeats: int) -> dict[str, float]:
    """llama-cpp-python in this process: decode tokens/s streamed (first to last token,
    as the servers are measured) and unstreamed (tokens over the whole call, prompt
    included), median of ``repeats``."""
    from llama_cpp import Llama

    llm = Llama(gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    streamed, whole = [], []
    for i in range(repeats):
        arrivals = []
        for chunk in llm.create_completion(
            PROMPTS[i % 8], max_tokens=max_tokens, temperature=0, stream=True
        ):
            if chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
        streamed.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
        t0 = time.perf_counter()
        out = llm.create_completion(PROMPTS[i % 8], max_tokens=max_tokens, temperature=0)
        whole.append(out["usage"]["completion_tokens"] / (time.perf_counter() - t0))
    del llm
    return {
        "streamed_decode_tps": statistics.median(streamed),
        "unstreamed_tokens_per_s": statistics.median(whole),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None
        for k in runs[0]
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--weights", choices=weights.CHOICES, default="q4_1", help="the GGUF every server loads"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--agentic-clients", type=int, default=8)
    p.add_argument("--peer-deps", default=".bench-deps/llama_server")
    p.add_argument("--out", type=Path, help="default bench/results/edge-servers[-WEIGHTS]")
    args = p.parse_args()
    out = args.out or ROOT / "bench" / "results" / (
        "edge-servers" + ("" if args.weights == "q4_1" else f"-{args.weights}")
    )
    gguf = str(weights.resolve(args.weights))
    built = subprocess.run(
        [str(HERE / "build-llama-server.sh")], stdout=subprocess.PIPE, text=True, check=True
    )
    llama_server = built.stdout.strip().splitlines()[-1]
    t = str(args.threads)
    ports = [free_port() for _ in range(3)]
    servers = [
        Server("ours", [sys.executable, "-m", "hybridllm_edge.cli", "serve", "--model", gguf,
                        "--parallel", str(SLOTS), "--threads", t, "--max-model-len", str(CONTEXT),
                        "--port", str(ports[0]), "--host", "127.0.0.1"], ports[0], True),
        Server("llama-server", [llama_server, "-m", gguf, "-t", t, "-tb", t, "-np", str(SLOTS), "-cb",
                                "-c", str(SLOTS * CONTEXT), "--port", str(ports[1]), "--host", "127.0.0.1"],
               ports[1], True),
        Server("llama_cpp.server", [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--n_ctx", "2048",
                                    "--n_threads", t, "--n_threads_batch", t, "--port", str(ports[2]),
                                    "--host", "127.0.0.1"], ports[2], False,
               {**os.environ, "PYTHONPATH": args.peer_deps}),
    ]  # fmt: skip
    report: dict[str, Any] = {
        "machine": machine(), "command": portable(" ".join(["uv run --no-sync python bench/edge/servers.py", *sys.argv[1:]])),
        "gguf": portable(gguf), "weights": args.weights, "threads": args.threads, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "per_client": args.per_client,
        "servers": {s.name: portable(" ".join(s.cmd)) for s in servers},
    }  # fmt: skip
    print("in-process baseline", flush=True)
    report["in_process"] = in_process(gguf, args.threads, args.max_tokens, 3)
    single: dict[str, list[float]] = {s.name: [] for s in servers if s.streams}
    loads: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for s in servers:
            s.proc = start(s.cmd, s.port, s.env)
            s.ask(*request_body("plain", 0, 4))  # warm up
        for r in range(args.rounds):
            for s in servers:
                if s.streams:
                    single[s.name].append(
                        stream(s.base, *request_body("plain", r, args.max_tokens))["decode_tps"]
                    )
            for kind, levels in (("plain", args.clients), ("agentic", [args.agentic_clients])):
                for c in levels:
                    print(f"round {r}: {kind}, {c} clients", flush=True)
                    for s in servers if r % 2 == 0 else servers[::-1]:
                        cell = loads.setdefault(f"{kind}:{c}", {}).setdefault(s.name, [])
                        cell.append(load(s, kind, c, args.per_client, args.max_tokens))
    finally:
        for s in servers:
            if s.proc is not None:
                stop(s.proc)
    report["load_end"] = list(os.getloadavg())
    report["single_stream"] = {name: statistics.median(v) for name, v in single.items()}
    report["loads"] = {
        key: {name: {**median_of(runs), "runs": runs} for name, runs in per.items()}
        for key, per in loads.items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m, names = report["machine"], list(report["servers"])
    single, ip = report["single_stream"], report["in_process"]
    lines = [
        f"# Edge runtime against llama-server and llama_cpp.server ({report['weights'].upper()})",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM; load average "
        f"{', '.join(f'{v:.1f}' for v in m['load'])} at start, "
        f"{', '.join(f'{v:.1f}' for v in report['load_end'])} at end (shared machine: compare the "
        "ratios, measured in the same run).",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Model: `{Path(report['gguf']).name}` for every server, {report['threads']} CPU thread(s) each, "
        f"greedy, max_tokens {report['max_tokens']}; medians over {report['rounds']} rounds, the servers' "
        "order alternating by round. Servers:",
        "",
        *[f"- {name}: `{cmd}`" for name, cmd in report["servers"].items()],
        "",
        "Peer settings and where they come from: llama-server is built from the llama.cpp that "
        "the locked llama-cpp-python vendors (`bench/edge/build-llama-server.sh`: the same "
        "commit, the same `GGML_NATIVE=OFF` flags as our build) and run as its README advises "
        "for several clients: `-np` parallel slots, continuous batching (`-cb`), the prompt "
        "cache (on by default), and a context of slots x 1024 so that each slot holds what one "
        "of ours does. llama_cpp.server runs with its defaults and the same threads; it needs "
        "`uv pip install --no-deps --target .bench-deps/llama_server sse-starlette "
        '"starlette-context<0.4"` first (packages the workspace does not lock).',
        "",
        "## Single stream (decode tokens/s, first to last streamed token)",
        "",
        "| ours | llama-server | ours / llama-server | llama-cpp-python in-process, streamed | in-process, unstreamed (tokens / call, prompt included) |",
        "|---|---|---|---|---|",
        f"| {single['ours']:.1f} | {single['llama-server']:.1f} | {single['ours'] / single['llama-server']:.2f} "
        f"| {ip['streamed_decode_tps']:.1f} | {ip['unstreamed_tokens_per_s']:.1f} |",
        "",
        "## Concurrent clients",
        "",
        f"Each client sends {report['per_client']} requests one after another (plain completions: eight "
        "different story prompts; agentic: chat with one shared system prompt of an agent's instructions "
        "and tools, and a different short task each). llama_cpp.server is asked unstreamed (no TTFT).",
        "",
        "| load | clients | " + " | ".join(f"{n} tok/s" for n in names)
        + " | ours / llama-server tok/s | " + " | ".join(f"{n} p50 / p95 s" for n in names)
        + " | ours / llama-server p95 | ours TTFT p50 / p95 s | llama-server TTFT p50 / p95 s |",
        "|---|---|" + "---|" * (2 * len(names) + 4),
    ]  # fmt: skip
    for key, per in report["loads"].items():
        kind, clients = key.split(":")
        o, ls = per["ours"], per["llama-server"]
        lines.append(
            f"| {kind} | {clients} | " + " | ".join(f"{per[n]['tokens_per_s']:.1f}" for n in names)
            + f" | {o['tokens_per_s'] / ls['tokens_per_s']:.2f} | "
            + " | ".join(f"{_f(per[n]['p50_latency_s'])} / {_f(per[n]['p95_latency_s'])}" for n in names)
            + f" | {o['p95_latency_s'] / ls['p95_latency_s']:.2f} | {_f(o['p50_ttft_s'])} / {_f(o['p95_ttft_s'])}"
            f" | {_f(ls['p50_ttft_s'])} / {_f(ls['p95_ttft_s'])} |"
        )  # fmt: skip
    lines.append("")
    path.write_text(portable("\n".join(lines)))


if __name__ == "__main__":
    raise SystemExit(main())
