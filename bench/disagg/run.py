"""Disaggregated vs monolithic serving on this machine, same run, same total cores.

    uv run python bench/disagg/run.py [--duration 60] [--repeats 3] [--out bench/results/disagg]

Deployments of SmolLM2-135M (real ``hybridllm-cloud serve`` processes, 2 cores in all):

- ``monolithic``: one process on both cores (2 torch threads);
- ``monolithic-1t``: the same with one torch thread (on two cores two threads contend
  with the server's own thread), and ``monolithic-1t-b128`` / ``-b64``: with a smaller step
  budget (``--max-num-batched-tokens``), so a long prompt's prefill chunk stalls the decode
  streams sharing its step for less: the tuned monolithic peers;
- ``disaggregated``: a ``--role prefill`` process pinned to core 0 and a ``--role decode``
  process pinned to core 1 (1 thread each); prompts over ``--threshold`` uncached tokens
  are prefilled remotely;
- ``two-replicas``: two monolithic processes, one per core, least-outstanding routing.

Workload (the same seeded schedule for every deployment): Poisson arrivals of short
interactive requests (``--short-len`` prompt tokens, ``--short-out`` output tokens, streamed)
plus a long prompt every ``--long-every`` seconds whose length is drawn from the Azure code
trace's context lengths (``../shared/traces/azure-2023``), scaled by ``--long-scale`` and
capped. Reported per deployment, medians over repeats: the interactive requests' p50/p99
time between tokens and TTFT, the long prompts' TTFT, and output tokens/s.

Part 2 measures the KV transfer alone: a decode worker without prefix caching asks a prefill
worker that already holds the prompt, so the prefill side computes one block and ships the
rest; bytes over transfer time is the transport's throughput, next to the TTFT it is part of.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portable import TRACES, machine_line, portable

ROOT = Path(__file__).resolve().parents[2]
TRACE = TRACES / "azure-2023" / "AzureLLMInferenceTrace_code.csv"
VOCAB = (2000, 40000)  # token ids drawn for synthetic prompts (plain word pieces)


def machine() -> str:
    return machine_line()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    url: str


def start(model: str, cores: set[int], threads: int, args: list[str], log: Path) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "hybridllm_cloud.cli", "serve", "--model", model,
           "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--torch-threads", str(threads), "--max-model-len", "2048",
           "--num-kv-blocks", "1024", "--max-waiting-requests", "1024", *args]  # fmt: skip
    popen = subprocess.Popen(
        cmd,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"{cmd} exited with {popen.returncode}; see {log}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return Proc(popen, url)
        time.sleep(0.5)
    raise TimeoutError(f"{cmd} not ready; see {log}")


def parse_deployment(name: str) -> tuple[str, int | None, int | None]:
    """``monolithic[-Nt][-bB]`` / ``two-replicas[-bB]`` / ``disaggregated[-nocache]``.

    ``-Nt``: N torch threads (monolithic only; default 2, one per core); ``-bB``: a step
    budget of B tokens (``--max-num-batched-tokens``; default the engine's 512), which caps
    how long one prefill chunk stalls the decode streams that share its step.
    """
    parts = name.split("-")
    base = "two-replicas" if name.startswith("two-replicas") else parts[0]
    rest = name[len(base) :].split("-")[1:]
    threads = budget = None
    if base == "disaggregated":
        if rest not in ([], ["nocache"]):
            raise ValueError(f"deployment {name!r}: disaggregated takes only -nocache")
        return base, None, None
    if base not in ("monolithic", "two-replicas"):
        raise ValueError(f"deployment {name!r}: monolithic, two-replicas or disaggregated")
    for part in rest:
        if part.endswith("t") and part[:-1].isdigit() and base == "monolithic":
            threads = int(part[:-1])
        elif part.startswith("b") and part[1:].isdigit():
            budget = int(part[1:])
        else:
            raise ValueError(f"deployment {name!r}: unknown part {part!r} (-Nt, -bB)")
    return base, threads, budget


def describe(name: str, threshold: int) -> str:
    """One line of what a deployment runs, for the report."""
    base, threads, budget = parse_deployment(name)
    step = f", step budget {budget} tokens" if budget else ", step budget 512 tokens (default)"
    if base == "monolithic":
        n = threads or 2
        return f"one process on both cores, {n} torch thread{'s' if n > 1 else ''}{step}"
    if base == "two-replicas":
        return f"two monolithic processes, one per core, 1 torch thread each{step}, least-outstanding routing"  # fmt: skip
    cache = " without prefix caching" if name.endswith("nocache") else ""
    return (
        f"prefill process on core 0 + decode process on core 1, 1 torch thread each{cache} "
        f"(local prefill up to {threshold} uncached tokens)"
    )


@contextlib.contextmanager
def deployment(name: str, model: str, log: Path, threshold: int) -> Iterator[list[str]]:
    """Starts the processes of one deployment; yields the URLs clients send to."""
    procs: list[Proc] = []
    try:
        base, threads, budget = parse_deployment(name)
        extra = ["--max-num-batched-tokens", str(budget)] if budget else []
        if base == "monolithic":
            procs.append(start(model, {0, 1}, threads or 2, extra, log))
            yield [procs[0].url]
        elif base == "two-replicas":
            procs += [start(model, {c}, 1, extra, log) for c in (0, 1)]
            yield [p.url for p in procs]
        elif name.startswith("disaggregated"):
            kv = free_port()
            procs.append(start(model, {0}, 1, ["--role", "prefill", "--kv-port", str(kv)], log))
            extra = ["--no-enable-prefix-caching"] if name == "disaggregated-nocache" else []
            procs.append(
                start(
                    model,
                    {1},
                    1,
                    [
                        "--role",
                        "decode",
                        "--prefill-url",
                        f"tcp://127.0.0.1:{kv}",
                        "--local-prefill-threshold",
                        str(threshold),
                        *extra,
                    ],
                    log,
                )
            )
            yield [procs[1].url]
    finally:
        for p in procs:
            p.popen.terminate()
        for p in procs:
            try:
                p.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.popen.kill()


# --------------------------------------------------------------------------- workload


@dataclass
class Arrival:
    at: float
    kind: str  # short | long
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    kind: str
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str | None = None


def long_lengths(scale: float, cap: int) -> list[int]:
    with TRACE.open() as f:
        lengths = [int(r["ContextTokens"]) for r in csv.DictReader(f)]
    return [max(64, min(cap, int(n * scale))) for n in lengths]


def schedule(args: argparse.Namespace, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    lengths = long_lengths(args.long_scale, args.long_cap)
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(args.short_rate)
        if t >= args.duration:
            break
        out.append(
            Arrival(
                t, "short", [rng.randrange(*VOCAB) for _ in range(args.short_len)], args.short_out
            )
        )
    t = args.long_every / 2
    while t < args.duration:
        n = rng.choice(lengths)
        out.append(Arrival(t, "long", [rng.randrange(*VOCAB) for _ in range(n)], args.long_out))
        t += args.long_every
    return sorted(out, key=lambda a: a.at)


async def one(client: httpx.AsyncClient, url: str, a: Arrival, t0: float) -> Result:
    body = {"model": "m", "prompt": a.prompt, "max_tokens": a.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    res = Result(a.kind, float("nan"))
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - sent
                else:
                    res.gaps.append(now - last)
                last = now
                res.tokens += 1
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter() - t0
    return res


async def replay(urls: list[str], arrivals: list[Arrival]) -> tuple[list[Result], float]:
    outstanding = dict.fromkeys(urls, 0)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()

        async def fire(a: Arrival) -> Result:
            delay = a.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)  # open-loop arrivals at their scheduled times
            url = min(urls, key=lambda u: outstanding[u])
            outstanding[url] += 1
            try:
                return await one(client, url, a, t0)
            finally:
                outstanding[url] -= 1

        results = await asyncio.gather(*(fire(a) for a in arrivals))
        return list(results), time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    short = [r for r in results if r.kind == "short" and r.error is None]
    long_ = [r for r in results if r.kind == "long" and r.error is None]
    gaps = [g for r in short for g in r.gaps]
    return {
        "short_tbt_p50_ms": 1000 * pct(gaps, 0.5),
        "short_tbt_p99_ms": 1000 * pct(gaps, 0.99),
        "short_ttft_p50_ms": 1000 * pct([r.ttft for r in short], 0.5),
        "short_ttft_p99_ms": 1000 * pct([r.ttft for r in short], 0.99),
        "long_ttft_p50_s": pct([r.ttft for r in long_], 0.5),
        "long_ttft_p99_s": pct([r.ttft for r in long_], 0.99),
        "output_tok_s": sum(r.tokens for r in results) / wall,
        "requests": len(results),
        "errors": sum(1 for r in results if r.error),
        "wall_s": wall,
    }


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def transfer_part(model: str, log: Path, lengths: list[int]) -> list[dict[str, Any]]:
    """KV transfer throughput per prompt length (see the module docstring)."""
    rng = random.Random(7)
    rows = []
    mono = start(model, {1}, 1, [], log)  # the local-prefill peer: one core, like a decode worker
    try:
        with deployment("disaggregated-nocache", model, log, 0) as (url,):
            for n in lengths:
                prompt = [rng.randrange(*VOCAB) for _ in range(n)]
                body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                t = time.perf_counter()
                httpx.post(mono.url + "/v1/completions", json=body, timeout=600).raise_for_status()
                local = time.perf_counter() - t
                t = time.perf_counter()
                httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
                cold = time.perf_counter() - t
                b0 = metric(url, "hybridllm_kv_transfer_bytes_total", direction="received")
                s0 = metric(url, "hybridllm_kv_transfer_seconds_sum")
                f0 = metric(url, "hybridllm_kv_transfer_streaming_seconds_sum")
                t = time.perf_counter()
                httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
                warm = time.perf_counter() - t
                nbytes = metric(url, "hybridllm_kv_transfer_bytes_total", direction="received") - b0
                secs = metric(url, "hybridllm_kv_transfer_seconds_sum") - s0
                stream = metric(url, "hybridllm_kv_transfer_streaming_seconds_sum") - f0
                rows.append({
                    "prompt_tokens": n, "kv_bytes": nbytes, "transfer_s": secs,
                    "streaming_s": stream, "gb_per_s": nbytes / stream / 1e9 if stream else None,
                    "ttft_warm_s": warm, "transfer_share_of_warm_ttft": secs / warm,
                    "ttft_remote_cold_s": cold, "ttft_local_s": local,
                })  # fmt: skip
                print(f"  transfer {n} tokens: {nbytes / 1e6:.1f} MB, request to DONE {secs * 1000:.1f} ms, "
                      f"first to last frame {stream * 1000:.1f} ms; TTFT warm {warm * 1000:.0f} ms, "
                      f"cold remote {cold * 1000:.0f} ms, local {local * 1000:.0f} ms", flush=True)  # fmt: skip
    finally:
        mono.popen.terminate()
        mono.popen.wait(timeout=30)
    return rows


def transport_alone(kv_bytes_per_token: int, lengths: list[int], repeats: int = 5) -> list[float]:
    """GB/s of the framing alone on loopback (sender and receiver in this process, one frame
    per layer as in a transfer, checksums on both sides, no model), per prompt length."""
    from hybridllm_cloud.disagg import protocol, transport

    layers = 30

    async def measure(n: int) -> float:
        size = kv_bytes_per_token * n // layers
        payload = memoryview(bytearray(os.urandom(1024)) * (size // 1024 + 1))[:size]

        async def send(conn: protocol.Conn) -> None:
            for layer in range(layers):
                await conn.send(protocol.Frame(protocol.FrameType.KV, 1, payload, layer, 1, 0, 1))

        server = await transport.start_server(transport.Endpoint("tcp", "127.0.0.1", 0), send)
        best = []
        for _ in range(repeats):
            t = time.perf_counter()
            conn = await transport.connect(
                transport.Endpoint("tcp", "127.0.0.1", server.address[1]), 5
            )
            for _ in range(layers):
                await conn.recv()
            best.append(size * layers / (time.perf_counter() - t) / 1e9)
            conn.close()
        await server.close()
        return statistics.median(best)

    return [asyncio.run(measure(n)) for n in lengths]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF-layout dir (default: the model store's SmolLM2)"
    )
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--short-rate", type=float, default=0.3, help="interactive requests/s")
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--short-out", type=int, default=32)
    ap.add_argument("--long-every", type=float, default=6.0, help="seconds between long prompts")
    ap.add_argument("--long-scale", type=float, default=0.5)
    ap.add_argument("--long-cap", type=int, default=1536)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument(
        "--threshold", type=int, default=256, help="decode role: local prefill up to N tokens"
    )
    ap.add_argument(
        "--deployments",
        default="monolithic,monolithic-1t,monolithic-1t-b128,monolithic-1t-b64,disaggregated,two-replicas",
        help="monolithic[-Nt][-bB], two-replicas[-bB], disaggregated[-nocache] (see parse_deployment)",
    )
    ap.add_argument("--transfer-lengths", default="128,256,512,1024,1536")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "disagg")
    args = ap.parse_args()
    if args.model is None:
        import hybridllm_models

        args.model = str(hybridllm_models.ensure())
    log = Path("/tmp/hybridllm-bench-disagg.log")
    names = args.deployments.split(",")
    for name in names:
        parse_deployment(name)  # a typo fails before the first run, not after an hour
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    started = time.time()
    for rep in range(args.repeats):
        arrivals = schedule(args, seed=rep)
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            with deployment(name, args.model, log, args.threshold) as urls:
                asyncio.run(replay(urls, schedule(args, seed=1000 + rep)[:3]))  # warm-up
                results, wall = asyncio.run(replay(urls, arrivals))
                summary = summarize(results, wall)
                if name == "disaggregated":
                    summary["remote_prefills"] = metric(
                        urls[0], "hybridllm_prefills_total", where="remote", outcome="ok"
                    )
                    summary["local_prefills"] = metric(
                        urls[0], "hybridllm_prefills_total", where="local"
                    )
                runs[name].append(summary)
                print(
                    f"repeat {rep} {name}: "
                    + ", ".join(f"{k}={v:.4g}" for k, v in summary.items()),
                    flush=True,
                )
    medians = {
        n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items() if rs
    }
    lengths = [int(x) for x in args.transfer_lengths.split(",")]
    transfer = transfer_part(args.model, log, lengths)
    if transfer:
        per_token = int(transfer[-1]["kv_bytes"] // transfer[-1]["prompt_tokens"])
        for row, gbps in zip(transfer, transport_alone(per_token, lengths), strict=True):
            row["transport_alone_gb_per_s"] = gbps
    report = {
        "machine": machine(),
        "command": "uv run python bench/disagg/run.py " + " ".join(sys.argv[1:]),
        "params": {
            k: portable(str(v)) if isinstance(v, Path) or k == "model" else v
            for k, v in vars(args).items()
        },
        "seconds": time.time() - started,
        "deployments": {n: describe(n, args.threshold) for n in names},
        "runs": runs,
        "medians": medians,
        "transfer": transfer,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    from report import write_report  # bench/disagg/report.py

    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
