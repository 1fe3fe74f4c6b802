"""The raw streaming path: a stream from a plain-http replica, over ``relay.py``'s pooled
upstream connections instead of aiohttp's client.

Up to the first body byte the attempt is awaited with the first-byte deadline (a pooled
connection found closed while idle is retried once on a new one, the replica not charged);
an error answer is read whole. Once committed, every upstream read is written to the
client's transport from the upstream's ``data_received`` (``sink``), the upstream's chunked
framing passed through as it came; the upstream stops being read while the client's socket
buffer is over its high-water mark, until the server's writer has drained (``_pump``). A
client gone mid-way aborts the upstream connection. Mixed into ``proxy.Forwarder``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from hybridllm_common import metrics as names
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import relay
from hybridllm_gateway.attempt import (
    ERROR_DETAIL_BYTES,
    RETRYABLE_STATUS,
    Attempts,
    Outcome,
    finish_stream,
    lost_reason,
    report_fault,
    sse_response,
    stream_error_event,
    token_events,
)

log = logging.getLogger("hybridllm_gateway.proxy")  # the forwarding's log, as before the split


class RawPath(Attempts):
    """The attempt, the relay from callbacks, and the wait while they relay."""

    async def _attempt_raw(
        self,
        request: web.Request,
        replica: balancer_mod.Replica,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        t_start: float,
        outcome: Outcome,
    ) -> tuple[web.StreamResponse | None, str]:
        assert self.pool is not None
        t_send = time.perf_counter()
        pre_s = t_send - t_start
        extra = {k: v for k, v in headers.items() if k != "content-type" and "\r" not in v and "\n" not in v}  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.first_byte_timeout_s, self.request_timeout_s)
        conn: relay.Upstream | None = None
        try:
            for fresh in (False, True):
                try:
                    if fresh:
                        conn = await self.pool.connect(relay.address(replica.url))
                        reused = False
                    else:
                        conn, reused = await self.pool.acquire(replica.url)
                except (OSError, TimeoutError) as exc:
                    self._fail(replica, "connect")
                    outcome.status, outcome.unsent = 0, True
                    return None, report_fault(
                        replica, f"could not connect ({type(exc).__name__})", exc
                    )
                conn.send(path, replica.url[len("http://") :].split("/", 1)[0], payload, extra)
                async with asyncio.timeout_at(deadline):
                    while conn.head is None and conn.lost is None:
                        await conn.wait()
                if conn.head is None and reused and conn.num_reads == 0:
                    log.debug("pooled connection to %s was closed while idle; new one", replica.url)
                    continue
                break
            assert conn is not None
            head = conn.head
            if head is None:
                self._fail(
                    replica, "malformed" if isinstance(conn.lost, relay.UpstreamError) else "read"
                )
                outcome.status = 0
                return None, report_fault(
                    replica, lost_reason(conn.lost) + " before the answer's head", conn.lost
                )
            self.metrics.upstream_latency.labels(tier=replica.tier).observe(
                time.perf_counter() - t_send
            )
            if head.status != 200:  # an error answer: read it whole
                async with asyncio.timeout_at(deadline):
                    while not conn.complete and conn.lost is None:
                        await conn.wait()
                if conn.lost is not None and not conn.complete:
                    self._fail(
                        replica,
                        "malformed" if isinstance(conn.lost, relay.UpstreamError) else "read",
                    )
                    outcome.status = 0
                    conn.abort()
                    return None, report_fault(
                        replica,
                        lost_reason(conn.lost) + f" in its HTTP {head.status} answer",
                        conn.lost,
                    )
                body = conn.payload()
                if head.status in RETRYABLE_STATUS:
                    retry_after = head.headers.get("retry-after")
                    self._refused(replica, head.status, retry_after, outcome)
                    conn.abort()
                    return None, report_fault(
                        replica, f"answered HTTP {head.status}", body[:ERROR_DETAIL_BYTES]
                    )
                self.balancer.record_success(replica)
                outcome.status, outcome.body, outcome.headers = head.status, body, head.headers
                outcome.ttft_s = time.perf_counter() - t_start
                outcome.added_s = pre_s
                conn.release()
                return None, ""
            async with asyncio.timeout_at(deadline):
                while not conn.body and not conn.complete and conn.lost is None:
                    await conn.wait()
            if not conn.body:
                self._fail(replica, "empty_stream")
                outcome.status = 0
                conn.abort()
                fault = lost_reason(conn.lost) if conn.lost is not None else "closed the stream"
                return None, report_fault(
                    replica, fault + " before the first byte", conn.lost or ""
                )
        except TimeoutError:
            if conn is not None:
                conn.abort()
            self._fail(replica, names.UpstreamErrorKind.TIMEOUT)
            outcome.status = 0
            return None, report_fault(replica, f"no answer within {self.first_byte_timeout_s:g} s")
        except BaseException:
            if conn is not None:
                conn.abort()
            raise
        self.balancer.record_success(replica)
        outcome.status = 200
        return await self._relay_raw(request, conn, replica, pre_s, t_start, outcome), ""

    async def _relay_raw(
        self,
        request: web.Request,
        conn: relay.Upstream,
        replica: balancer_mod.Replica,
        pre_s: float,
        t_start: float,
        outcome: Outcome,
    ) -> web.StreamResponse:
        t_first = time.perf_counter()
        out = sse_response(request, replica)
        out.enable_chunked_encoding()
        down = request.transport
        framed = conn.scanner is not None  # upstream chunks pass through as framed
        gone = False
        try:
            outcome.started = True
            await out.prepare(request)
            request.writer.send_headers()
            if down is None or down.is_closing():
                raise ConnectionResetError("client closed the connection")
            high = down.get_write_buffer_limits()[1]

            def sink(data: bytes) -> None:
                nonlocal gone
                if down.is_closing():
                    gone = True
                    conn.abort()
                    conn.complete = True
                    return
                outcome.num_chunks += token_events(data)
                if b"data: [DONE]" in data:  # the answer's last event: a client may close now
                    outcome.delivered = True
                down.write(data if framed else b"%x\r\n%b\r\n" % (len(data), data))
                if down.get_write_buffer_size() > high:
                    conn.pause()

            sink(conn.take_body())
            outcome.ttft_s = time.perf_counter() - t_start
            outcome.first_token(replica)
            outcome.added_s = pre_s + (time.perf_counter() - t_first)
            conn.sink = sink
            await self._pump(request, conn)
        except (ConnectionResetError, RuntimeError) as exc:
            log.info("client went away mid-stream (%s); closing upstream %s", exc, replica.url)
            conn.abort()
            return out
        except TimeoutError:
            log.warning("upstream %s stalled mid-stream; closing it", replica.url)
            self._fail(replica, "mid_stream")
            outcome.broken = True
            conn.abort()
            return out
        except BaseException:  # cancelled: the client closed its connection
            outcome.delivered = outcome.delivered or (
                conn.complete and conn.lost is None and not gone
            )
            conn.abort()
            raise
        if gone:
            log.info("client went away mid-stream; closed upstream %s", replica.url)
            return out
        if conn.lost is not None:
            log.warning("upstream %s broke mid-stream: %r", replica.url, conn.lost)
            self._fail(replica, "mid_stream")
            outcome.broken = True
            conn.abort()
            if framed and conn.scanner is not None and conn.scanner.left:
                # Cut inside an upstream chunk: no valid framing can follow, so the
                # client's connection is cut too (it sees an incomplete body, an error).
                down.abort()
                return out
            event = stream_error_event(replica)
            down.write(b"%x\r\n%b\r\n" % (len(event), event))
            await out.write_eof()
            return out
        conn.release()
        outcome.delivered = True  # every byte written: the rest is the terminator
        await finish_stream(out)
        return out

    async def _pump(self, request: web.Request, conn: relay.Upstream) -> None:
        """Waits while the callbacks relay: for the end, a loss, or a pause to drain.

        An upstream that sends nothing for ``first_byte_timeout_s`` (or runs past the
        request timeout) raises TimeoutError.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + self.request_timeout_s
        while not conn.complete and conn.lost is None:
            if conn.paused:
                await request.writer.drain()
                conn.resume()
                continue
            reads = conn.num_reads
            idle_until = min(loop.time() + self.first_byte_timeout_s, end)
            try:
                async with asyncio.timeout_at(idle_until):
                    await conn.wait()
            except TimeoutError:
                if conn.num_reads == reads or loop.time() >= end:
                    raise
