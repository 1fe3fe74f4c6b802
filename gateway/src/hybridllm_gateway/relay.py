"""The streaming hot path: upstream HTTP/1.1 connections as ``asyncio.Protocol`` objects.

Why not aiohttp's client here: profiled at 256 concurrent streams, most of the gateway's
Python time per SSE chunk went to the generic path - the client protocol, its chunked
parser, a ``StreamReader`` buffer, waking the relaying task, ``iter_any``, the server's
``StreamWriter`` re-framing each chunk. A stream here needs none of it: once the answer
is committed, every upstream read is written to the client from ``data_received``
itself, with no task switch and no copy, and the upstream's chunked framing is passed
through as it came (both sides speak HTTP/1.1 chunked; only the terminating ``0`` chunk
is held back, so the server's own ``write_eof`` ends the stream). The framing is
followed with bytes operations (``ChunkScanner``) only to find the end of the body.

Backpressure: when the client's socket buffer passes its high-water mark the upstream
socket stops being read (``pause_reading``) until the server's writer has drained, so a
slow client slows the upstream and nothing piles up in the gateway.

Everything before the first byte (connect, request, status, headers, first body bytes)
is awaited normally with timeouts; ``proxy.Forwarder`` keeps the retry and ejection
logic. Idle connections are kept per replica for reuse (HTTP keep-alive); a reused
connection that fails before any answer byte is retried once on a fresh connection
without charging the replica (the server may have closed it while idle).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 << 20  # default cap of an answer the gateway holds in memory
IDLE_KEEP_S = 30.0


class UpstreamError(Exception):
    """The upstream failed: connection refused or lost, malformed answer.

    ``fault`` says what went wrong in words a client may read (never the upstream's bytes
    or address); ``str()`` adds the offending bytes, for the gateway's log."""

    def __init__(self, fault: str, detail: bytes | str = b"") -> None:
        super().__init__(f"{fault}: {detail!r}" if detail else fault)
        self.fault = fault


class ChunkScanner:
    """Follows HTTP/1.1 chunked framing in raw bytes to find where the body ends.

    ``feed(data)`` returns the bytes to relay: ``data`` itself in the common case (whole
    chunks), less the terminating zero-size chunk and its trailers, and with a size line
    split across reads held back until it is complete (it could be the terminator).
    ``done`` turns true once the terminator and trailers are consumed. With ``keep`` the
    chunk payloads are also collected in ``payload`` (for small error bodies).
    """

    def __init__(self, keep: bool = False) -> None:
        self.left = 0  # bytes left in the current chunk: payload, then its CRLF
        self.held = b""  # the start of a size or trailer line split across reads
        self.last = False  # past the terminating chunk's size line: trailers
        self.done = False
        self.keep = keep
        self.payload: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        pos, n = 0, len(data)
        prefix, cut = b"", 0 if self.last else n
        while pos < n and not self.done:
            if self.left:
                take = min(self.left, n - pos)
                if self.keep and self.left > 2:
                    self.payload.append(data[pos : pos + min(take, self.left - 2)])
                self.left -= take
                pos += take
                continue
            end = data.find(b"\n", pos)
            if end < 0:
                self.held += data[pos:]
                if len(self.held) > 4096:
                    raise UpstreamError("chunk size or trailer line over 4096 bytes")
                if not self.last:
                    cut = pos
                break
            held, self.held = self.held, b""
            line = (held + data[pos:end]).strip()
            start, pos = pos, end + 1
            if self.last:  # a trailer line; the empty one ends the message
                self.done = not line
                continue
            size = chunk_size(line)
            if size == 0:
                self.last, cut = True, start
                continue
            if held:  # a split size line: its first part goes out before data
                prefix = held
            self.left = size + 2
        if prefix or cut < n:
            return prefix + data[:cut]
        return data


HEX_DIGITS = b"0123456789abcdefABCDEF"
MAX_CHUNK_SIZE_DIGITS = 16  # a 64-bit size; longer is no real chunk


def chunk_size(line: bytes) -> int:
    """The size of a chunk size line (``1a``, ``1a;ext=v``): hex digits only. ``int(x, 16)``
    alone also takes ``-6``, ``+6``, ``0x6`` and ``1_0``; a negative size would step the
    scanner backwards forever on the event loop."""
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > MAX_CHUNK_SIZE_DIGITS or digits.strip(HEX_DIGITS):
        raise UpstreamError("bad chunk size line", line[:40])
    return int(digits, 16)


@dataclass
class Head:
    status: int
    headers: dict[str, str]
    chunked: bool
    length: int | None  # Content-Length, when not chunked
    keep_alive: bool


def parse_head(raw: bytes) -> Head:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise UpstreamError("not an HTTP/1.x status line", lines[0][:80])
    try:
        status = int(parts[1])
    except ValueError:
        raise UpstreamError("bad status line", lines[0][:80]) from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    length = None
    if not chunked and "content-length" in headers:
        value = headers["content-length"]
        if not value.isascii() or not value.isdigit() or len(value) > 18:
            raise UpstreamError("bad content-length", value[:40])
        length = int(value)
    conn = headers.get("connection", "").lower()
    keep_alive = parts[0] == "HTTP/1.1" and "close" not in conn and (chunked or length is not None)
    return Head(status, headers, chunked, length, keep_alive)


class Upstream(asyncio.Protocol):
    """One upstream connection: one request at a time, then back to the pool."""

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.num_bytes = 0  # body bytes of the current answer held in memory
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: Head | None = None
        self.scanner: ChunkScanner | None = None
        self.left = -1  # Content-Length bytes left; -1: until the connection closes
        self.body: list[bytes] = []  # body bytes not yet handed on
        self.sink: Callable[[bytes], None] | None = None  # relay mode: where body bytes go
        self.complete = False
        self.lost: BaseException | None = None
        self.closed = False
        self.num_reads = 0
        self.paused = False  # reading paused for the client's sake (backpressure)
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.head is not None and self.left == -1 and self.scanner is None:
                self.complete = True  # close-delimited body ends here
            elif self.lost is None:  # a fault found in its bytes stays the cause
                self.lost = exc or ConnectionResetError("upstream closed the connection")
        self.pool.forget(self)
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.num_reads += 1
        if self.head is None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    self._fail(UpstreamError("response head over 64 KiB"))
                return
            try:
                self.head = parse_head(bytes(self.buf[:end]))
            except UpstreamError as exc:
                self._fail(exc)
                return
            data = bytes(self.buf[end + 4 :])
            self.buf.clear()
            if self.head.chunked:  # the payload is kept apart for error answers only
                self.scanner = ChunkScanner(keep=self.head.status != 200)
            elif self.head.length is not None:
                self.left = self.head.length
            if self.head.status in (204, 304) or (self.head.length == 0):
                self.complete = True
            self._wake()
            if not data:
                return
        self._body(data)

    def _body(self, data: bytes) -> None:
        if self.complete:
            return
        sc = self.scanner
        if sc is not None:
            try:
                body = sc.feed(data)
            except UpstreamError as exc:
                self._fail(exc)
                return
            self.complete = sc.done
        elif self.left >= 0:
            body = data[: self.left]
            self.left -= len(body)
            self.complete = self.left == 0
        else:
            body = data
        if body:
            if self.sink is not None:  # relayed as it comes: the client's pace bounds it
                self.sink(body)
            else:  # held (an error answer, a stream's first bytes): bounded here
                self.num_bytes += len(body)
                if self.num_bytes > self.pool.max_body_bytes:
                    self._fail(UpstreamError(f"answer is over {self.pool.max_body_bytes} bytes"))
                    return
                self.body.append(body)
                self._wake()
        if self.complete:
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        self.lost = exc
        self.abort()
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- used by the forwarder
    async def wait(self) -> None:
        """Until the next event (head, body bytes, completion, loss, a pause)."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True

    def send(self, path: str, host: str, payload: bytes, extra: dict[str, str]) -> None:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
        assert self.transport is not None
        self.transport.write(head.encode("latin-1") + b"\r\n" + payload)

    def take_body(self) -> bytes:
        """Body bytes read so far, as they came (chunk framing included)."""
        out = b"".join(self.body)
        self.body.clear()
        return out

    def payload(self) -> bytes:
        """The decoded body of a non-200 answer, once complete."""
        if self.scanner is not None:
            return b"".join(self.scanner.payload)
        return self.take_body()

    def pause(self) -> None:
        if self.transport is not None and not self.paused:
            self.transport.pause_reading()
            self.paused = True
            self._wake()

    def resume(self) -> None:
        if self.transport is not None and self.paused and not self.closed:
            self.transport.resume_reading()
        self.paused = False

    def release(self) -> None:
        """Back to the pool when the answer ended cleanly and may be reused, else closed."""
        reusable = (
            self.complete and self.lost is None and self.head is not None and self.head.keep_alive
        )
        if reusable and not self.closed:
            self.head, self.scanner, self.sink, self.left = None, None, None, -1
            self.complete, self.num_reads, self.num_bytes = False, 0, 0
            self.body.clear()
            self.idle_since = time.monotonic()
            self.pool.put(self)
        else:
            self.abort()


@dataclass
class Pool:
    """Idle keep-alive connections per (host, port); LIFO so warm sockets are reused."""

    connect_timeout_s: float
    max_body_bytes: int = MAX_BODY_BYTES
    idle: dict[tuple[str, int], list[Upstream]] = field(default_factory=dict)

    async def acquire(self, url: str) -> tuple[Upstream, bool]:
        """A connection to ``url`` and whether it was reused from the pool."""
        key = address(url)
        stack = self.idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if not conn.closed and now - conn.idle_since < IDLE_KEEP_S:
                return conn, True
            conn.abort()
        return await self.connect(key), False

    async def connect(self, key: tuple[str, int]) -> Upstream:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, proto = await loop.create_connection(lambda: Upstream(self, key), key[0], key[1])
        return proto

    def put(self, conn: Upstream) -> None:
        self.idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: Upstream) -> None:
        stack = self.idle.get(conn.key)
        if stack and conn in stack:
            stack.remove(conn)

    def close(self) -> None:
        for stack in self.idle.values():
            for conn in stack:
                conn.abort()
        self.idle.clear()


@functools.lru_cache(maxsize=1024)
def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the raw relay speaks plain http only, not {url!r}")
    return parts.hostname, parts.port or 80


def supports(url: str) -> bool:
    return url.startswith("http://")
