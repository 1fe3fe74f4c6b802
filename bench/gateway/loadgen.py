"""The benchmark's load generator: C streaming (or, ``--no-stream``, plain) requests in flight.

Closed loop, as the goal says ("256 concurrent streaming requests"): each of C workers
sends a streaming chat request on its own keep-alive HTTP/1.1 connection, reads it to the
end and sends the next. Two choices keep the offered load the same for every target and
free of artefacts:

- Staggered start. Worker i sends its first request at ``i * period / C`` (``period``
  is one stream's nominal length, tokens / rate), so requests arrive evenly, one every
  ``period / C`` seconds. Started all at once, C fixed-length streams would finish and
  restart together, and the p99 would measure that synchronised burst, not the target.
- Measurement window. Only requests sent after the ramp (every worker started) and
  before ``ramp + duration`` are recorded; the workers stop sending at the window's end
  and finish what is in flight.

Two clocks per request, both from the moment just before the request's ``send``:

- **wire** (the ``ttft_*`` / ``e2e_*`` keys): the kernel's receive timestamp of the
  socket read that brought the first body byte (and the last), ``SO_TIMESTAMPNS``. It is
  when the answer reached this machine's client socket, whether or not this process had
  a CPU at that moment: what a client with a core of its own would see.
- **app** (``app_ttft_*`` / ``app_e2e_*``): when this process got to read it. On a
  2-core machine that shares its CPUs with the backend and the proxy, this adds the
  load generator's own wait for a CPU (``loadgen_runq_s``), the same for every target
  but different in each repeat: noise in a difference of two p99s.

The client is a small HTTP/1.1 reader on non-blocking sockets (``recvmsg`` in the event
loop's reader callback; the chunked framing followed by the gateway's tested
``ChunkScanner``), because a client library does not expose the kernel's timestamps.
Prints one JSON line with percentiles, completed requests per second over the window,
errors, and the CPU seconds this process used (``resource.getrusage``) and waited for a
CPU while runnable (``/proc/self/schedstat``).

    python bench/gateway/loadgen.py --url http://127.0.0.1:8000 --concurrency 256 \
        --duration 10 --tokens 64 --rate 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import struct
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from hybridllm_gateway.relay import ChunkScanner, UpstreamError, parse_head

KEY = "sk-bench-master-key-0123456789abcdef"  # every target checks it: same work per request
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; not exported by every build
MAX_HEAD = 64 * 1024


def runq_wait_s() -> float:
    """Seconds this process spent runnable but waiting for a CPU (/proc schedstat)."""
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Conn:
    """One keep-alive connection; one request at a time; times from the reader callback."""

    def __init__(self, loop: asyncio.AbstractEventLoop, addr: tuple[str, int]) -> None:
        self.loop, self.addr = loop, addr
        self.sock: socket.socket | None = None
        self.done: asyncio.Future[None] | None = None

    async def open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        try:
            await self.loop.sock_connect(sock, self.addr)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.loop.add_reader(sock.fileno(), self._readable)

    def close(self) -> None:
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def request(self, payload: bytes, timeout_s: float) -> tuple[float, float, float, float]:
        """Sends one request; (wire ttft, wire e2e, app ttft, app e2e) in seconds.

        Raises ``UpstreamError`` for a non-200 answer, a broken or malformed one.
        """
        if self.sock is None:
            await self.open()
        assert self.sock is not None
        self.buf = bytearray()
        self.head_len = -1
        self.status = 0
        self.scanner: ChunkScanner | None = None
        self.left = -1
        self.keep_alive = True
        self.first_wire = self.first_app = 0.0
        self.end_wire = self.end_app = 0.0
        self.error: str | None = None
        self.done = self.loop.create_future()
        self.t_wall, self.t_mono = time.time(), time.perf_counter()
        try:
            self.sock.send(payload)  # a few hundred bytes into an empty socket buffer
            async with asyncio.timeout(timeout_s):
                await self.done
        except BaseException:
            self.close()
            raise
        if self.error is not None:
            self.close()
            raise UpstreamError(self.error)
        if not self.keep_alive:
            self.close()
        return (
            self.first_wire - self.t_wall,
            self.end_wire - self.t_wall,
            self.first_app - self.t_mono,
            self.end_app - self.t_mono,
        )

    def _readable(self) -> None:
        sock = self.sock
        while sock is not None:
            try:
                data, anc, _, _ = sock.recvmsg(65536, 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._finish(f"read: {exc}")
                return
            now = time.perf_counter()
            wire = time.time()
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    wire = sec + nsec / 1e9
            if not data:
                self._finish("connection closed mid-answer" if self.done_pending() else None)
                self.close()
                return
            if self.done_pending():
                self._feed(data, wire, now)

    def done_pending(self) -> bool:
        return self.done is not None and not self.done.done()

    def _feed(self, data: bytes, wire: float, now: float) -> None:
        if self.head_len < 0:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self._finish("answer head over 64 KiB")
                return
            try:
                head = parse_head(bytes(self.buf[:end]))
            except UpstreamError as exc:
                self._finish(str(exc))
                return
            self.head_len, self.status, self.keep_alive = end, head.status, head.keep_alive
            if head.chunked:
                self.scanner = ChunkScanner()
            elif head.length is not None:
                self.left = head.length
            data = bytes(self.buf[end + 4 :])
            self.buf.clear()
            if not data and (self.left == 0 or head.status in (204, 304)):
                self._complete(wire, now)
                return
        if not data:
            return
        if not self.first_wire:
            self.first_wire, self.first_app = wire, now
        if self.scanner is not None:
            try:
                self.scanner.feed(data)
            except UpstreamError as exc:
                self._finish(str(exc))
                return
            if self.scanner.done:
                self._complete(wire, now)
        elif self.left >= 0:
            self.left -= len(data)
            if self.left <= 0:
                self._complete(wire, now)

    def _complete(self, wire: float, now: float) -> None:
        self.end_wire, self.end_app = wire, now
        if not self.first_wire:
            self.first_wire, self.first_app = wire, now
        self._finish(None if self.status == 200 else f"HTTP {self.status}")

    def _finish(self, error: str | None) -> None:
        if self.done_pending():
            self.error = error
            assert self.done is not None
            self.done.set_result(None)


async def load(
    url: str,
    concurrency: int,
    duration: float,
    tokens: int,
    rate: float,
    timeout_s: float = 30.0,
    stream: bool = True,
) -> dict[str, Any]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SystemExit(f"--url: plain http://host:port expected, not {url!r}")
    addr = (parts.hostname, parts.port or 80)
    body = json.dumps({
        "model": "smollm2", "stream": stream, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Say hello."}],
    }).encode()  # fmt: skip
    payload = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {addr[0]}:{addr[1]}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
        f"Accept: {'text/event-stream' if stream else 'application/json'}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    period = tokens / rate
    times: dict[str, list[float]] = {k: [] for k in ("ttft", "e2e", "app_ttft", "app_e2e")}
    errors = 0
    first_errors: list[str] = []
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    window_start = t0 + period
    window_end = window_start + duration

    async def worker(i: int) -> None:
        nonlocal errors
        conn = Conn(loop, addr)
        await asyncio.sleep(i * period / concurrency)
        try:
            while time.perf_counter() < window_end:
                recorded = time.perf_counter() >= window_start
                try:
                    got = await conn.request(payload, timeout_s)
                except (OSError, TimeoutError, UpstreamError) as exc:
                    errors += recorded
                    if len(first_errors) < 3:
                        first_errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if recorded:
                    for key, value in zip(times, got, strict=True):
                        times[key].append(value)
        finally:
            conn.close()

    cpu0, wait0 = resource.getrusage(resource.RUSAGE_SELF), runq_wait_s()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    cpu1, wait1 = resource.getrusage(resource.RUSAGE_SELF), runq_wait_s()
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    out: dict[str, Any] = {"completed": len(times["e2e"]), "errors": errors,
                           "rps": len(times["e2e"]) / duration}  # fmt: skip
    for key, xs in times.items():
        out[f"{key}_p50"], out[f"{key}_p99"] = pct(xs, 0.5), pct(xs, 0.99)
    out.update(loadgen_cpu_s=cpu_s, loadgen_runq_s=wait1 - wait0,
               loadgen_wall_s=time.perf_counter() - t0, first_errors=first_errors)  # fmt: skip
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="non-streaming requests: the whole answer at once (TTFT = its first byte)",
    )
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        print("uvloop missing: load generator on asyncio", file=sys.stderr)
    print(
        json.dumps(
            asyncio.run(
                load(a.url, a.concurrency, a.duration, a.tokens, a.rate, a.timeout, not a.no_stream)
            )
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
