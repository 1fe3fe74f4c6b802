"""Gateway benchmark: added latency and throughput, gateway vs direct vs LiteLLM's proxy.

One backend, the fixed-rate token server (``--tokens`` tokens per stream at ``--rate``
tokens/s per stream, like an LLM decoding at tens of tokens per second), is measured
three ways in the same run: direct, through our gateway, and through LiteLLM's proxy
configured for the same backend. For each concurrency level C the load generator
(``loadgen.py``, its own process) keeps C streams in flight, started evenly over one
stream's length, and records the requests sent in a ``--duration`` second window. Each
cell is repeated ``--repeats`` times, targets alternating inside a repeat; the report
gives medians over repeats. Added latency is the target's percentile minus direct's
percentile of the same repeat and concurrency: the same offered load, since a closed loop
of C fixed-length streams offers C / stream-length requests per second whatever answers.
CPU seconds of every process (load generator, backend, proxy) and of the whole machine
are recorded per cell, so a reader sees where the cores went.

    uv run --no-sync python bench/gateway/run.py --litellm PATH/TO/litellm

One benchmark at a time on the machine (no build or test run beside it).

Writes ``bench/results/<out>.json``, ``<out>.md`` and ``<out>.png`` (``--out gateway``).
``--profile S`` also records the gateway with py-spy for S seconds during its first cell
at the highest concurrency (``<out>-profile.svg``). Loopback only; every server is
started and stopped here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import procs
import report
from loadgen import KEY

TOKENSERVER = Path(__file__).resolve().parents[1] / "tokenserver.py"

ROOT = Path(__file__).resolve().parents[2]
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"


def run_cell(url: str, c: int, args: argparse.Namespace, sids: dict[str, int]) -> dict[str, Any]:
    client = procs.cpu_sets(args.cpu_layout)["client"]
    pin = ["taskset", "-c", ",".join(map(str, sorted(client)))] if client else []
    cmd = [*pin, sys.executable, str(LOADGEN), "--url", url, "--concurrency", str(c),
           "--duration", str(args.duration), "--tokens", str(args.tokens), "--rate", str(args.rate), "--timeout", str(args.timeout)]  # fmt: skip
    if getattr(args, "no_stream", False):
        cmd.append("--no-stream")
    cpu0 = {name: procs.session_cpu_s(sid) for name, sid in sids.items()}
    pids = {name: procs.session_pids(sid) for name, sid in sids.items()}
    wait0 = {name: procs.runq_wait_s(p) for name, p in pids.items()}
    busy0, t0 = procs.machine_busy_s(), time.perf_counter()
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.duration * 4 + args.timeout + 120
    )
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    cell: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    cell["wall_s"] = wall
    # cores used over the cell: CPU seconds / wall seconds
    cell["cores"] = {name: (procs.session_cpu_s(sid) - cpu0[name]) / wall for name, sid in sids.items()}  # fmt: skip
    cell["cores"]["loadgen"] = cell["loadgen_cpu_s"] / wall
    cell["cores"]["machine"] = (procs.machine_busy_s() - busy0) / wall
    # run-queue wait: share of the cell each process was runnable but had no CPU
    cell["runq"] = {name: procs.runq_delta_s(wait0[name], procs.runq_wait_s(p)) / wall for name, p in pids.items()}  # fmt: skip
    cell["runq"]["loadgen"] = cell["loadgen_runq_s"] / wall
    return cell


def start_servers(args: argparse.Namespace, tmp: Path, running: list[Any]) -> tuple[dict[str, str], dict[str, int]]:  # fmt: skip
    py = sys.executable
    cpus = procs.cpu_sets(args.cpu_layout)
    bport = procs.free_port()
    backend = f"http://127.0.0.1:{bport}"
    running.append(procs.start([py, str(TOKENSERVER), "--port", str(bport),
                                "--rate", str(args.rate), "--id", "backend"], tmp / "backend.log", cpus=cpus["backend"]))  # fmt: skip
    procs.wait_up(backend, running[-1], "/health")
    urls, sids = {"direct": backend}, {"backend": running[-1].pid}
    routing = {"model": "smollm2", "policy": "cloud-only",
               "rateLimits": {"requestsPerMinute": 10**7, "tokensPerMinute": 10**9},
               "tiers": {"cloud": {"backends": [{"url": backend, "revision": "v1", "weight": 100}]}}}  # fmt: skip
    (tmp / "routing.json").write_text(json.dumps(routing))
    (tmp / "keys").write_text(f"bench:{hashlib.sha256(KEY.encode()).hexdigest()}\n")
    for name, relay in (("gateway", "raw"), ("gateway-aiohttp", "aiohttp")):
        if name not in args.targets:
            continue
        gport = procs.free_port()
        running.append(procs.start([py, "-m", "hybridllm_gateway.cli", "serve", "--config",
                                    str(tmp / "routing.json"), "--port", str(gport), "--host", "127.0.0.1",
                                    "--workers", str(args.workers), "--api-keys-file", str(tmp / "keys"),
                                    "--stream-relay", relay], tmp / f"{name}.log", cpus=cpus["proxy"]))  # fmt: skip
        urls[name] = f"http://127.0.0.1:{gport}"
        sids[name] = running[-1].pid
        procs.wait_up(urls[name], running[-1], "/health")
    if "nullproxy" in args.targets:
        nport = procs.free_port()
        running.append(procs.start([py, str(Path(__file__).resolve().parent / "nullproxy.py"), "--port", str(nport),
                                    "--backend", f"127.0.0.1:{bport}"], tmp / "nullproxy.log", cpus=cpus["proxy"]))  # fmt: skip
        urls["nullproxy"] = f"http://127.0.0.1:{nport}"
        sids["nullproxy"] = running[-1].pid
        procs.wait_up(urls["nullproxy"], running[-1], "/health")
    native = [(n, m) for n, m in (("go-http", "http"), ("go-tcp", "tcp")) if n in args.targets]
    binary = goproxy() if native else None
    for name, mode in native:
        port = procs.free_port()
        running.append(procs.start([str(binary), "-mode", mode, "-listen", f"127.0.0.1:{port}",
                                    "-backend", f"127.0.0.1:{bport}"], tmp / f"{name}.log", cpus=cpus["proxy"]))  # fmt: skip
        urls[name] = f"http://127.0.0.1:{port}"
        sids[name] = running[-1].pid
        procs.wait_up(urls[name], running[-1], "/health")
    if args.litellm and "litellm" in args.targets:
        lport = procs.free_port()
        (tmp / "litellm.yaml").write_text(litellm_config(backend))
        running.append(procs.start([args.litellm, "--config", str(tmp / "litellm.yaml"), "--port", str(lport),
                                    "--host", "127.0.0.1", "--num_workers", str(args.litellm_workers)],
                                   tmp / "litellm.log", LITELLM_ENV, cpus["proxy"]))  # fmt: skip
        urls["litellm"] = f"http://127.0.0.1:{lport}"
        sids["litellm"] = running[-1].pid
        procs.wait_up(urls["litellm"], running[-1], "/health/liveliness", timeout_s=240)
    return urls, sids


# LiteLLM as its own benchmark page configures it for performance
# (https://docs.litellm.ai/docs/benchmarks): no callbacks, no retries, a 30 s request
# timeout, workers equal to the CPU count ("Setting workers equal to CPU count gives optimal
# performance"); no database, so nothing is written per request.
LITELLM_SETTINGS = {"callbacks": "[]", "num_retries": "0", "request_timeout": "30",
                    "telemetry": "false", "drop_params": "true"}  # fmt: skip
LITELLM_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False"}


def litellm_config(backend: str) -> str:
    settings = "".join(f"  {k}: {v}\n" for k, v in LITELLM_SETTINGS.items())
    return (
        "model_list:\n  - model_name: smollm2\n    litellm_params:\n"
        f"      model: openai/smollm2\n      api_base: {backend}/v1\n      api_key: sk-none\n"
        f"litellm_settings:\n{settings}"
        f"general_settings:\n  master_key: {KEY}\n"
    )


def litellm_version(cli: str) -> str:
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=120)
    found = re.search(r"Current Version = (\S+)", out.stdout + out.stderr)
    return found.group(1) if found else "(version not reported)"


def peers(args: argparse.Namespace) -> list[str]:
    """Each target's settings and where they come from, for the report."""
    out = [
        f"- gateway: `hybridllm-gateway serve --workers {args.workers}` (one process is its "
        "measured best on two cores: `gateway-workers2.md` found a second worker slower), "
        "API-key auth, a routing table with one cloud backend, raw stream relay.",
        "- nullproxy: a bare TCP relay in one Python process (`bench/gateway/nullproxy.py`): "
        "no HTTP parsing, the floor of any Python hop.",
        "- go-http: Go's `httputil.ReverseProxy` (`bench/gateway/goproxy`, standard library, "
        "`FlushInterval: -1`), what a native HTTP proxy costs.",
    ]
    if args.litellm and "litellm" in args.targets:
        settings = ", ".join(f"`{k}: {v}`" for k, v in LITELLM_SETTINGS.items())
        out.append(
            f"- litellm: LiteLLM's proxy {litellm_version(args.litellm)} from PyPI "
            f"(`uv venv DIR && uv pip install --python DIR 'litellm[proxy]'`), `--num_workers {args.litellm_workers}` (workers = "
            f"CPU count), `litellm_settings`: {settings}; the `openai/` provider, which its "
            "load-test page recommends; no database. Settings from "
            "https://docs.litellm.ai/docs/benchmarks."
        )
    return [line for line in out if line.split(":", 1)[0][2:] in args.targets]


def goproxy() -> Path:
    """Builds the native peers (``goproxy/``, standard library only) into the cache."""
    out = Path.home() / ".cache" / "hybridllm" / "bench" / "goproxy"
    src = Path(__file__).resolve().parent / "goproxy"
    try:
        subprocess.run(["go", "build", "-o", str(out), "."], cwd=src, check=True)
    except FileNotFoundError:
        raise SystemExit("the go-http / go-tcp targets need Go on PATH (go build)") from None
    return out


def profile(pid: int, seconds: float, path: Path) -> subprocess.Popen[bytes]:
    """py-spy (through uvx) on the gateway, in the background while a cell runs."""
    cmd = ["uvx", "py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
           "--nonblocking", "--subprocesses", "-o", str(path)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", default="1,64,256,1000")
    p.add_argument("--duration", type=float, default=6.0, help="measurement window, seconds")
    p.add_argument("--timeout", type=float, default=30.0, help="per request; slower is an error")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--rate", type=float, default=32.0, help="tokens per second per stream")
    p.add_argument("--workers", type=int, default=1, help="gateway processes")
    p.add_argument(
        "--litellm-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="LiteLLM processes (default: the CPU count, as LiteLLM's benchmark docs say)",
    )
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="non-streaming requests (the whole answer at once) instead of streams",
    )
    p.add_argument(
        "--targets",
        default="direct,nullproxy,gateway,litellm,go-http",
        help="direct; nullproxy (a bare TCP relay in Python, the floor for a Python process); "
        "gateway (raw stream relay); gateway-aiohttp (the same gateway, streams through "
        "aiohttp's client); litellm; go-http (Go's httputil.ReverseProxy: a native HTTP "
        "proxy) and go-tcp (a bare TCP relay in Go), what a native hot path would cost",
    )
    p.add_argument(
        "--cpu-layout",
        choices=("shared", "split", "client"),
        default="shared",
        help="shared: no pinning; split: the proxy under test alone on the last CPU, load "
        "generator and backend on the others; client: the load generator alone on the first "
        "CPU, backend and proxy on the others (direct runs with the same pinning)",
    )
    p.add_argument("--litellm", default="", help="path of the litellm CLI (a separate venv)")
    p.add_argument("--profile", type=float, default=0.0, help="py-spy seconds (0: none)")
    p.add_argument(
        "--out", default="", help="results name (default: gateway, or gateway-nonstream)"
    )
    p.add_argument("--note", default="", help="a line for the report (e.g. what else ran)")
    args = p.parse_args()
    args.targets = args.targets.split(",")
    args.out = args.out or ("gateway-nonstream" if args.no_stream else "gateway")
    levels = [int(x) for x in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="gwbench-"))
    running: list[subprocess.Popen[bytes]] = []
    load_before = procs.load_average()
    try:
        urls, sids = start_servers(args, tmp, running)
        warm = argparse.Namespace(duration=1.0, tokens=4, rate=args.rate, timeout=args.timeout,
                                  cpu_layout=args.cpu_layout)  # fmt: skip
        for url in urls.values():  # connection pools and imports
            run_cell(url, 8, warm, {})
        raw: dict[str, dict[int, list[dict[str, Any]]]] = {t: {c: [] for c in levels} for t in urls}
        for rep in range(args.repeats):
            for c in levels:
                for name, url in urls.items():
                    spy = None
                    if args.profile and name == "gateway" and rep == 0 and c == max(levels):
                        spy = profile(sids["gateway"], args.profile, report.RESULTS / f"{args.out}-profile.svg")  # fmt: skip
                    inner = name.startswith("gateway")
                    before = procs.added_buckets(url) if inner else {}
                    cell = run_cell(url, c, args, {"backend": sids["backend"], **({"proxy": sids[name]} if name in sids else {})})  # fmt: skip
                    if spy is not None:
                        spy.wait(timeout=120)
                    if inner:
                        after = procs.added_buckets(url)
                        cell["inner_p50"] = procs.bucket_quantile(before, after, 0.5)
                        cell["inner_p99"] = procs.bucket_quantile(before, after, 0.99)
                    raw[name][c].append(cell)
                    if cell["errors"]:
                        procs.drain(url)
                    cores = " ".join(f"{k}={v:.2f}" for k, v in cell["cores"].items())
                    cores += " runq: " + " ".join(f"{k}={v:.3f}" for k, v in cell["runq"].items())
                    print(f"rep {rep} c={c:5d} {name:8s} rps={cell['rps']:8.1f} "
                          f"ttft p50={1000 * (cell['ttft_p50'] or 0):7.2f} ms "
                          f"p99={1000 * (cell['ttft_p99'] or 0):7.2f} ms "
                          f"(app {1000 * (cell['app_ttft_p99'] or 0):7.2f} ms) "
                          f"e2e p99={1000 * (cell['e2e_p99'] or 0):7.1f} ms errors={cell['errors']} cores: {cores}",
                          flush=True)  # fmt: skip
    finally:
        for proc in reversed(running):
            procs.stop(proc)
    nice = f"nice -n {os.nice(0)} " if os.nice(0) else ""
    # What reproduces the run, relative to the repository (how runs were serialised on the
    # machine, such as a lock around each benchmark, is not part of it).
    argv = ["PATH/TO/litellm" if args.litellm and a == args.litellm else a for a in sys.argv[1:]]
    cmd = f"{nice}uv run --no-sync python bench/gateway/run.py " + " ".join(argv)  # fmt: skip
    report.write(raw, levels, args, cmd, (load_before, procs.load_average()), peers(args))


if __name__ == "__main__":
    main()
