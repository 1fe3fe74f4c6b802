"""Gateway benchmark: added latency and throughput, gateway vs direct vs LiteLLM's proxy.

One backend (the fixed-rate token server: ``--tokens`` tokens per stream at ``--rate``
tokens/s) is measured three ways in the same run: direct, through our gateway, and
through LiteLLM's proxy configured for the same backend. For each concurrency level a
load generator *in its own process* keeps C streaming requests in flight for
``--duration`` seconds and reports time to first token (TTFT), end-to-end latency and
completed requests per second; every cell is repeated ``--repeats`` times and the
median is reported. Added latency is the target's TTFT percentile minus the direct
TTFT percentile of the same repeat.

    uv run --with uvloop python bench/gateway/run.py --litellm /tmp/litellm-venv/bin/litellm

Writes ``bench/results/gateway.json``, ``gateway.md`` and ``gateway.png``. Loopback only;
every server is started and stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-bench-master-key-0123456789abcdef"  # both proxies check it: same work per request
RESULTS = ROOT / "bench" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- load generator


async def _load(url: str, concurrency: int, duration: float, tokens: int) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({
        "model": "smollm2", "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    }).encode()  # fmt: skip
    ttft: list[float] = []
    e2e: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)  # a request slower than this is an error
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with session.post(
                        url + "/v1/chat/completions", data=body,
                        headers={"content-type": "application/json", "authorization": "Bearer " + KEY},
                    ) as r:  # fmt: skip
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            continue
                        first = None
                        async for _ in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter()
                        ttft.append((first or time.perf_counter()) - t0)
                        e2e.append(time.perf_counter() - t0)
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "completed": len(e2e),
        "errors": errors,
        "rps": len(e2e) / elapsed,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p50": pct(e2e, 0.5),
        "e2e_p99": pct(e2e, 0.99),
    }


def loadgen_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--tokens", type=int, required=True)
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        print("uvloop missing: load generator on asyncio", file=sys.stderr)
    print(json.dumps(asyncio.run(_load(a.url, a.concurrency, a.duration, a.tokens))))


# --------------------------------------------------------------------------- servers


def wait_up(url: str, proc: subprocess.Popen[bytes], path: str, timeout_s: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status < 500:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        start_new_session=True,
    )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1),
            "python": platform.python_version(), "os": platform.platform()}  # fmt: skip


def added_buckets(url: str) -> dict[float, float]:
    """The gateway's own added-latency histogram (cumulative counts by upper bound)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("hybridllm_gateway_added_latency_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """Upper bound of the bucket holding quantile q of the observations between two scrapes."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    for le, n in counts:
        if n >= q * total:
            return le
    return None


def drain(url: str, timeout_s: float = 180.0) -> None:
    """Waits until the target answers one request, so a backlog left by a cell (requests
    the load generator gave up on) does not spill CPU into the next cell."""
    import urllib.request

    body = json.dumps({"model": "smollm2", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "authorization": "Bearer " + KEY})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
    except OSError as exc:
        print(f"drain of {url} did not finish: {exc}", flush=True)


def run_cell(url: str, c: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "loadgen", "--url", url, "--concurrency", str(c),
           "--duration", str(args.duration), "--tokens", str(args.tokens)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration * 4 + 120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "loadgen":
        loadgen_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", default="1,64,256,1000")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    p.add_argument("--litellm", default="", help="path of the litellm CLI (a separate venv)")
    p.add_argument("--out", default="gateway")
    args = p.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="gwbench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bport = free_port()
        backend = f"http://127.0.0.1:{bport}"
        procs.append(start([sys.executable, "-m", "hybridllm_gateway.tokenserver", "--port", str(bport),
                            "--rate", str(args.rate), "--id", "backend"], tmp / "backend.log"))  # fmt: skip
        wait_up(backend, procs[-1], "/health")
        targets = {"direct": backend}
        routing = {"model": "smollm2", "policy": "cloud-only",
                   "rateLimits": {"requestsPerMinute": 10**7, "tokensPerMinute": 10**9},
                   "tiers": {"cloud": {"backends": [{"url": backend, "revision": "v1", "weight": 100}]}}}  # fmt: skip
        (tmp / "routing.json").write_text(json.dumps(routing))
        import hashlib

        (tmp / "keys").write_text(f"bench:{hashlib.sha256(KEY.encode()).hexdigest()}\n")
        gport = free_port()
        procs.append(start([sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config",
                            str(tmp / "routing.json"), "--port", str(gport), "--host", "127.0.0.1",
                            "--workers", str(args.workers), "--api-keys-file", str(tmp / "keys")],
                           tmp / "gateway.log"))  # fmt: skip
        targets["gateway"] = f"http://127.0.0.1:{gport}"
        wait_up(targets["gateway"], procs[-1], "/health")
        if args.litellm:
            lport = free_port()
            (tmp / "litellm.yaml").write_text(
                "model_list:\n  - model_name: smollm2\n    litellm_params:\n"
                f"      model: openai/smollm2\n      api_base: {backend}/v1\n      api_key: sk-none\n"
                "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
                "general_settings:\n  master_key: sk-bench-master-key-0123456789abcdef\n"
            )
            procs.append(start([args.litellm, "--config", str(tmp / "litellm.yaml"), "--port", str(lport),
                                "--host", "127.0.0.1", "--num_workers", str(args.workers)],
                               tmp / "litellm.log", {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}))  # fmt: skip
            targets["litellm"] = f"http://127.0.0.1:{lport}"
            wait_up(targets["litellm"], procs[-1], "/health/liveliness", timeout_s=240)
        for url in targets.values():  # warm connection pools and imports
            run_cell(url, 8, argparse.Namespace(duration=1.0, tokens=args.tokens))
        raw: dict[str, dict[int, list[dict[str, Any]]]] = {
            t: {c: [] for c in levels} for t in targets
        }
        for rep in range(args.repeats):
            for c in levels:
                for name, url in targets.items():
                    before = added_buckets(url) if name == "gateway" else {}
                    cell = run_cell(url, c, args)
                    if name == "gateway":
                        after = added_buckets(url)
                        cell["inner_p50"] = bucket_quantile(before, after, 0.5)
                        cell["inner_p99"] = bucket_quantile(before, after, 0.99)
                    raw[name][c].append(cell)
                    if cell["errors"]:
                        drain(url)
                    print(f"rep {rep} c={c:5d} {name:8s} rps={cell['rps']:8.1f} "
                          f"ttft p50={1000 * (cell['ttft_p50'] or 0):7.2f} ms "
                          f"p99={1000 * (cell['ttft_p99'] or 0):7.2f} ms errors={cell['errors']}", flush=True)  # fmt: skip
    finally:
        for proc in reversed(procs):
            stop(proc)
    report(raw, levels, args)


def median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def report(
    raw: dict[str, dict[int, list[dict[str, Any]]]], levels: list[int], args: argparse.Namespace
) -> None:
    summary: dict[str, Any] = {}
    for c in levels:
        row: dict[str, Any] = {}
        direct = raw["direct"][c]
        for name, per_level in raw.items():
            cells = per_level[c]
            row[name] = {
                k: median([x[k] for x in cells]) for k in ("rps", "ttft_p50", "ttft_p99", "e2e_p99")
            }
            row[name]["errors"] = sum(x["errors"] for x in cells)
            if name != "direct":
                for q in ("ttft_p50", "ttft_p99"):
                    diffs = [
                        (x[q] - d[q]) if x[q] is not None and d[q] is not None else None
                        for x, d in zip(cells, direct, strict=True)
                    ]
                    row[name][f"added_{q}"] = median(diffs)
                row[name]["rps_vs_direct"] = row[name]["rps"] / row["direct"]["rps"]
            if name == "gateway":
                for q in ("inner_p50", "inner_p99"):
                    row[name][q] = median([x.get(q) for x in cells])
        if "litellm" in row and row["litellm"]["rps"]:
            row["gateway"]["rps_vs_litellm"] = row["gateway"]["rps"] / row["litellm"]["rps"]
        summary[str(c)] = row
    cmd = "uv run --with uvloop python bench/gateway/run.py " + " ".join(sys.argv[1:])
    doc = {"machine": machine(), "command": cmd, "args": vars(args), "summary": summary, "raw": raw}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2))
    lines = [
        "# Gateway benchmark", "",
        f"Machine: {doc['machine']['cores']} cores, {doc['machine']['cpu']}, {doc['machine']['ram_gib']} GiB RAM "
        "(shared and noisy: compare ratios within this run).", "",
        f"Command: `{cmd}`", "",
        f"Backend: fixed-rate token server, {args.tokens} tokens per stream at {args.rate:g} tokens/s; "
        f"load generator in its own process; {args.duration:g} s per cell, median of {args.repeats} repeats; "
        f"gateway workers: {args.workers}.", "",
        "Added p50/p99: the target's TTFT percentile minus direct's, same repeat (includes waiting "
        "for a CPU on this shared machine). In-gateway p50/p99: the gateway's own "
        "`hybridllm_gateway_added_latency_seconds` histogram over the cell (bucket upper bounds): "
        "time its code held the request before sending it upstream and between the first upstream "
        "byte and its write to the client.", "",
        "| concurrency | target | req/s | vs direct | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms | in-gateway p50 / p99 ms | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.2f}"

    for c in levels:
        for name, r in summary[str(c)].items():
            vs = "1.00" if name == "direct" else f"{r['rps_vs_direct']:.2f}"
            lines.append(f"| {c} | {name} | {r['rps']:.1f} | {vs} | {ms(r['ttft_p50'])} | {ms(r['ttft_p99'])} | "
                         f"{ms(r.get('added_ttft_p50'))} | {ms(r.get('added_ttft_p99'))} | "
                         f"{ms(r.get('inner_p50'))} / {ms(r.get('inner_p99'))} | {r['errors']} |")  # fmt: skip
    if "litellm" in raw:
        ratios = [
            f"{c}: {summary[str(c)]['gateway']['rps_vs_litellm']:.1f}x"
            if "rps_vs_litellm" in summary[str(c)]["gateway"]
            else f"{c}: LiteLLM completed no request within the 60 s request timeout"
            for c in levels
        ]
        lines += ["", "Gateway throughput / LiteLLM throughput: " + "; ".join(ratios)]
    lines += ["", f"![throughput and added latency]({args.out}.png)", ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    plot(summary, levels, RESULTS / f"{args.out}.png")
    print("\n".join(lines))


def plot(summary: dict[str, Any], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(summary[str(levels[0])])
    for name in names:
        a.plot(levels, [summary[str(c)][name]["rps"] for c in levels], marker="o", label=name)
        if name != "direct":
            added = [summary[str(c)][name].get("added_ttft_p99") for c in levels]
            b.plot(levels, [1000 * x if x else float("nan") for x in added], marker="o", label=name)
    a.set(
        xscale="log", xlabel="concurrent streams", ylabel="completed requests/s", title="Throughput"
    )
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms",
          title="Added TTFT p99 vs direct (missing: nothing completed)")  # fmt: skip
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
