"""Diagnostics behind the gateway benchmark's explanations, each rerunnable by itself.

``gc``: the gateway's garbage-collector pauses under 256 streams, with the heap frozen at
start-up (as shipped) and unfrozen again (as before the freeze), same backend and load.
The gateway runs under a small wrapper that times every collection (``gc.callbacks``).

``chunk``: the gateway's Python work per relayed SSE chunk, in process: the upstream
protocol's ``data_received`` through the chunk scanner into a client sink that does what
the relay's sink does (a do-nothing transport stands in for the socket, so the kernel's
``send`` is not counted).

``wakeup``: what one wake-up of a process on the other CPU costs on this machine: a
round trip through two pipes between processes pinned to different CPUs, 2 ms apart, with
the machine otherwise idle and with a busy nice-15 job (another engineer's) on each CPU.

    uv run --no-sync python bench/gateway/diagnostics.py gc chunk wakeup

Writes ``bench/results/gateway-diagnostics.md`` (and prints it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import procs

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
LOADGEN = Path(__file__).resolve().parent / "loadgen.py"
TOKENSERVER = Path(__file__).resolve().parents[1] / "tokenserver.py"

# Run as the gateway's process: times each collection, writes them at exit.
GC_WRAPPER = r"""
import atexit, gc, json, sys, time
pauses, t = [], [0.0]
def timed(phase, info):
    if phase == "start":
        t[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - t[0], time.monotonic()))
gc.callbacks.append(timed)
out, unfreeze = sys.argv[1], sys.argv[2] == "unfreeze"
atexit.register(lambda: open(out, "w").write(json.dumps(pauses)))
from hybridllm_gateway import app as app_mod
if unfreeze:
    create = app_mod.create_app
    def create_unfrozen(settings):
        app = create(settings)
        async def thaw(app):
            gc.unfreeze()
        app.on_startup.append(thaw)  # after the app's own freeze
        return app
    app_mod.create_app = create_unfrozen
from hybridllm_gateway.cli import main
sys.argv = ["hybridllm-gateway", "serve", *sys.argv[3:]]
main()
"""


def gc_pauses(seconds: float) -> list[str]:
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="gwdiag-"))
    bport = procs.free_port()
    backend = procs.start([py, str(TOKENSERVER), "--port", str(bport),
                           "--rate", "32", "--id", "backend"], tmp / "backend.log")  # fmt: skip
    lines = ["## Garbage-collector pauses at 256 streams", "",
             f"{seconds:g} s of 256 streams (64 tokens at 32 tokens/s) after a 3 s warm-up; "
             "pauses timed with `gc.callbacks`.", "",
             "| heap | collections gen 0 / 1 / 2 | gen 1 median, ms | gen 2 longest, ms | longest, ms | total, ms |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    try:
        procs.wait_up(f"http://127.0.0.1:{bport}", backend, "/health")
        routing = {"model": "smollm2", "policy": "cloud-only",
                   "rateLimits": {"requestsPerMinute": 10**7, "tokensPerMinute": 10**9},
                   "tiers": {"cloud": {"backends": [{"url": f"http://127.0.0.1:{bport}", "revision": "v1", "weight": 100}]}}}  # fmt: skip
        (tmp / "routing.json").write_text(json.dumps(routing))
        for mode in ("freeze", "unfreeze"):
            gport, out = procs.free_port(), tmp / f"gc-{mode}.json"
            gw = procs.start([py, "-c", GC_WRAPPER, str(out), mode, "--config", str(tmp / "routing.json"),
                              "--port", str(gport), "--host", "127.0.0.1"], tmp / f"gateway-{mode}.log")  # fmt: skip
            url = f"http://127.0.0.1:{gport}"
            try:
                procs.wait_up(url, gw, "/health")
                load = [py, str(LOADGEN), "--url", url, "--concurrency", "256", "--tokens", "64", "--rate", "32"]  # fmt: skip
                subprocess.run([*load, "--duration", "3"], check=True, capture_output=True)
                since = time.monotonic()  # CLOCK_MONOTONIC: the same clock in both processes
                subprocess.run([*load, "--duration", str(seconds)], check=True, capture_output=True)  # fmt: skip
            finally:
                procs.stop(gw)
            pauses = [(g, p) for g, p, at in json.loads(out.read_text()) if at >= since]
            by_gen = {g: sorted(p for gg, p in pauses if gg == g) for g in (0, 1, 2)}
            g1 = by_gen[1]
            lines.append(
                f"| {'frozen at start-up (shipped)' if mode == 'freeze' else 'unfrozen'} | "
                f"{len(by_gen[0])} / {len(g1)} / {len(by_gen[2])} | "
                f"{1000 * g1[len(g1) // 2] if g1 else 0:.2f} | "
                f"{1000 * max(by_gen[2], default=0):.2f} | "
                f"{1000 * max((p for _, p in pauses), default=0):.2f} | "
                f"{1000 * sum(p for _, p in pauses):.1f} |"
            )
    finally:
        procs.stop(backend)
    return lines


def chunk_cost(n: int = 200_000) -> list[str]:
    from hybridllm_gateway import relay

    event = b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":1,"model":"smollm2","system_fingerprint":"backend","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n'  # fmt: skip
    framed = b"%x\r\n%b\r\n" % (len(event), event)

    class Transport:  # the client socket, minus the kernel
        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 0

    down, count = Transport(), [0]

    def sink(data: bytes) -> None:  # what rawpath.RawPath._relay_raw's sink does per read
        if down.is_closing():
            return
        count[0] += data.count(b"data: ")
        down.write(data)
        if down.get_write_buffer_size() > 65536:
            raise AssertionError("never full here")

    up = relay.Upstream(relay.Pool(1.0), ("127.0.0.1", 1))
    up.head = relay.Head(200, {}, True, None, True)
    up.scanner, up.sink = relay.ChunkScanner(), sink
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            up.data_received(framed)
        best = min(best, (time.perf_counter() - t) / n)
    assert count[0] == 5 * n
    return ["## Python work per relayed chunk", "",
            f"`Upstream.data_received` -> `ChunkScanner.feed` -> the relay's sink, one "
            f"{len(framed)}-byte framed SSE event per read, best of 5 x {n:,}: "
            f"**{1e6 * best:.2f} µs** per chunk (64 chunks per benchmark stream: "
            f"{64 * 1e3 * best:.3f} ms per stream)."]  # fmt: skip


PINGPONG = r"""
import os, sys, time
gap, n = float(sys.argv[1]), int(sys.argv[2])
a_r, a_w = os.pipe(); b_r, b_w = os.pipe()
if os.fork() == 0:
    os.sched_setaffinity(0, {1})
    while (d := os.read(a_r, 1)) != b"q":
        os.write(b_w, d)
    os._exit(0)
os.sched_setaffinity(0, {0})
rtt = []
for _ in range(n):
    time.sleep(gap)
    t = time.perf_counter(); os.write(a_w, b"x"); os.read(b_r, 1)
    rtt.append(time.perf_counter() - t)
os.write(a_w, b"q"); os.wait()
rtt.sort()
print(rtt[len(rtt) // 2], rtt[int(0.99 * len(rtt))])
"""


def wakeup(n: int = 3000) -> list[str]:
    if len(os.sched_getaffinity(0)) < 2:
        return ["## Cross-CPU wake-up", "", "Skipped: fewer than 2 CPUs."]
    lines = ["## Cross-CPU wake-up", "",
             f"Round trip through two pipes, processes pinned to CPU 0 and CPU 1, {n} round "
             "trips 2 ms apart.", "", "| other work | p50, µs | p99, µs |", "|---|---:|---:|"]  # fmt: skip
    for busy in (False, True):
        hogs = [subprocess.Popen(["nice", "-n", "15", sys.executable, "-c",
                                  f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
                for cpu in (0, 1)] if busy else []  # fmt: skip
        try:
            out = subprocess.run([sys.executable, "-c", PINGPONG, "0.002", str(n)],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        p50, p99 = map(float, out.split())
        what = "a busy nice-15 job on each CPU" if busy else "none (the benchmark's own only)"
        lines.append(f"| {what} | {1e6 * p50:.0f} | {1e6 * p99:.0f} |")
    return lines


def main(argv: list[str]) -> int:
    parts = argv or ["gc", "chunk", "wakeup"]
    unknown = set(parts) - {"gc", "chunk", "wakeup"}
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}: choose from gc, chunk, wakeup")
    m = procs.machine()
    lines = ["# Gateway diagnostics", "",
             f"Machine: {m['cores']} cores, {m['cpu']}, {m['ram_gib']} GiB RAM, Python {m['python']}; "
             f"load average {procs.load_average()} at the start.", "",
             f"Command: `uv run --no-sync python bench/gateway/diagnostics.py {' '.join(parts)}`", ""]  # fmt: skip
    for part in parts:
        lines += {"gc": lambda: gc_pauses(60.0), "chunk": chunk_cost, "wakeup": wakeup}[part]()
        lines.append("")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gateway-diagnostics.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
