"""The benchmark's load generator: C streaming requests kept in flight, one process.

Closed loop, as the goal says ("256 concurrent streaming requests"): each of C workers
sends a streaming chat request, reads it to the end and sends the next. Two choices keep
the offered load the same for every target and free of artefacts:

- Staggered start. Worker i sends its first request at ``i * period / C`` (``period``
  is one stream's nominal length, tokens / rate), so requests arrive evenly, one every
  ``period / C`` seconds. Started all at once, C fixed-length streams would finish and
  restart together, and the p99 would measure that synchronised burst, not the target.
- Measurement window. Only requests sent after the ramp (every worker started) and
  before ``ramp + duration`` are recorded; the workers stop sending at the window's end
  and finish what is in flight.

Per request: time to first byte (TTFT) and to the last byte (end-to-end). Prints one
JSON line with percentiles, completed requests per second over the window, errors and
the CPU seconds this process used (``resource.getrusage``) and the seconds it waited
for a CPU while runnable (``/proc/self/schedstat``).

    python bench/gateway/loadgen.py --url http://127.0.0.1:8000 --concurrency 256 \
        --duration 10 --tokens 64 --rate 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from typing import Any

KEY = "sk-bench-master-key-0123456789abcdef"  # every target checks it: same work per request


def runq_wait_s() -> float:
    """Seconds this process spent runnable but waiting for a CPU (/proc schedstat)."""
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def load(
    url: str, concurrency: int, duration: float, tokens: int, rate: float, timeout_s: float = 30.0
) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({
        "model": "smollm2", "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    }).encode()  # fmt: skip
    headers = {"content-type": "application/json", "authorization": "Bearer " + KEY}
    period = tokens / rate
    ttft: list[float] = []
    e2e: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)  # a request slower than this is an error
    t0 = time.perf_counter()
    window_start = t0 + period
    window_end = window_start + duration

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        t_sent = time.perf_counter()
        recorded = t_sent >= window_start
        try:
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                if r.status != 200:
                    await r.read()
                    errors += recorded
                    return
                first = None
                async for _ in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                t_end = time.perf_counter()
        except (aiohttp.ClientError, TimeoutError):
            errors += recorded
            return
        if recorded:
            ttft.append((first or t_end) - t_sent)
            e2e.append(t_end - t_sent)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def worker(i: int) -> None:
            await asyncio.sleep(i * period / concurrency)
            while time.perf_counter() < window_end:
                await one(session)

        cpu0, wait0 = resource.getrusage(resource.RUSAGE_SELF), runq_wait_s()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        cpu1, wait1 = resource.getrusage(resource.RUSAGE_SELF), runq_wait_s()
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "completed": len(e2e),
        "errors": errors,
        "rps": len(e2e) / duration,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p50": pct(e2e, 0.5),
        "e2e_p99": pct(e2e, 0.99),
        "loadgen_cpu_s": cpu_s,
        "loadgen_runq_s": wait1 - wait0,
        "loadgen_wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        print("uvloop missing: load generator on asyncio", file=sys.stderr)
    print(
        json.dumps(asyncio.run(load(a.url, a.concurrency, a.duration, a.tokens, a.rate, a.timeout)))
    )


if __name__ == "__main__":
    main(sys.argv[1:])
