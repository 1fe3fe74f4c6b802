"""Forwarding one request: replica attempts, retries before the first byte, streaming.

An attempt fails when the connection cannot be made, the upstream answers 5xx, or it
sends no first byte within ``first_byte_timeout_s``; then the replica is charged a failure
(see the balancer's ejection) and the next replica is tried, in this tier and then in the
route's next tier, up to ``max_attempts``. Once the first byte is in hand the answer is
committed. Streams from plain-http replicas take the raw path (``relay.py``: upstream
bytes written to the client from the upstream's ``data_received``, reading paused while
the client's socket is full); others, and non-streaming answers, go through aiohttp's
client (``iter_any`` and ``write``, whose drain also gives backpressure). A 4xx is passed
through as the runtime wrote it. A client that goes away cancels the handler (aiohttp
``handler_cancellation``) or is seen closed at the next write; either way the upstream
connection is closed, not drained, so the runtime sees the disconnect and stops
generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import metrics as metrics_mod
from hybridllm_gateway import relay, router
from hybridllm_gateway.errors import APIError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
HOLD_POLL_S = 0.5  # how often a tier at zero is asked whether a replica is up
SERVICE_RETRY_S = 0.25  # the pause before trying a Service address again, times attempts
RETRY_UNREACHABLE_S = 5  # Retry-After of a request refused because its tier is unreachable


# Events of a stream that carry no token: the end, the usage chunk (stream_options), a
# finish chunk with an empty delta (OpenAI's), and a first chunk that only names the role
# (vLLM's); in the compact and the spaced JSON layouts. A chunk whose text is empty is a
# token all the same: the runtimes here stream the stop token, which their usage counts,
# and a token that ends mid-character, that way. Counted on the raw bytes, unparsed.
_NO_TOKEN = (
    b"data: [DONE]", b'"choices": []', b'"choices":[]', b'"delta": {}', b'"delta":{}',
    b'"delta": {"role": "assistant", "content": ""}', b'"delta":{"role":"assistant","content":""}',
)  # fmt: skip


def token_events(data: bytes) -> int:
    """The SSE events in ``data`` that carry a token: the runtimes stream one token per
    event, so this is the answer's completion tokens, as their usage counts them."""
    n = data.count(b"data: ")
    return n - sum(data.count(p) for p in _NO_TOKEN) if n else 0


@dataclass
class Outcome:
    """What the forwarding did, for metrics, the token bucket and the cascade."""

    tier: str = ""
    status: int = 0
    num_chunks: int = 0  # a streamed answer's token events (see token_events)
    body: bytes | None = None  # non-streaming answers only
    headers: dict[str, str] = field(default_factory=dict)
    added_s: float = 0.0
    ttft_s: float = 0.0
    attempts: list[str] = field(default_factory=list)
    unsent: bool = False  # the last attempt could not connect: the request never left
    revision: str = ""  # model revision of the replica that answered (the last attempt)
    broken: bool = False  # the answer started and then broke (counted as a failed attempt)
    # the upstream's whole stream reached the client's socket: a client that closes its
    # connection at once (cancelling the handler) has had its answer
    delivered: bool = False
    busy: int = 0  # attempts a replica refused as full (503 with Retry-After)
    retry_after: str = ""  # the last such refusal's Retry-After
    replica: str = ""  # URL of the replica of the last attempt
    load: int = 0  # its outstanding requests when the last attempt was sent (itself included)
    sent_s: float = 0.0  # when the last attempt was sent, from the request's arrival


@dataclass
class Forwarder:
    session: aiohttp.ClientSession
    balancer: balancer_mod.Balancer
    metrics: metrics_mod.GatewayMetrics
    connect_timeout_s: float
    first_byte_timeout_s: float
    request_timeout_s: float
    max_attempts: int
    pool: relay.Pool | None = None  # None: streams go through aiohttp's client too
    hold_timeout_s: float = 240.0
    max_held_requests: int = 256
    max_body_bytes: int = relay.MAX_BODY_BYTES  # a whole answer held past it is a fault
    backend_headers: dict[str, str] = field(default_factory=dict)  # the backend token's
    _wakers: dict[str, asyncio.Task[bool]] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)  # requests waiting, per tier

    def headers_for(
        self, replica: balancer_mod.Replica, headers: dict[str, str] | None = None
    ) -> dict[str, str]:
        """``headers`` and the backend token, for a replica in the cluster (a device is never
        shown it: it would open every runtime of the service)."""
        base = dict(headers or {})
        return base if replica.device else {**base, **self.backend_headers}

    def _fail(self, replica: balancer_mod.Replica, kind: str) -> None:
        self.metrics.upstream_errors.labels(tier=replica.tier, kind=kind).inc()
        self.metrics.revision_attempts.labels(
            tier=replica.tier, revision=replica.revision, result="error"
        ).inc()
        if self.balancer.record_failure(replica):
            self.metrics.ejections.labels(tier=replica.tier).inc()
            log.warning("ejected %s (%s tier) after repeated failures", replica.url, replica.tier)

    def _refused(
        self, replica: balancer_mod.Replica, status: int, retry_after: str | None, outcome: Outcome
    ) -> None:
        """A retryable error answer. A 503 with Retry-After is a replica that is full
        (its queue at its limit) or still loading: healthy, so not a failure towards its
        ejection (ejecting replicas for being busy would take capacity away exactly when
        it is short) nor against its model revision; the request goes to another one."""
        outcome.status = status
        if status == 503 and retry_after:
            outcome.busy += 1
            outcome.retry_after = retry_after
            self.metrics.upstream_errors.labels(tier=replica.tier, kind="busy").inc()
            return
        self._fail(replica, f"http_{status}")

    async def forward(
        self,
        request: web.Request,
        path: str,
        payload: bytes,
        tiers: tuple[str, ...],
        key: str | None,
        stream: bool,
        t_start: float,
        outcome: Outcome | None = None,
    ) -> tuple[web.StreamResponse | None, Outcome]:
        """Sends the request; for a stream, writes the answer and returns the response.
        ``outcome``, when given, is filled in as the attempts go (the caller reads it even
        when the handler is cancelled)."""
        outcome = Outcome() if outcome is None else outcome
        tried: set[str] = set()
        headers = {"content-type": "application/json"}
        rid = request.headers.get("x-request-id")
        if rid:
            headers["x-request-id"] = rid
        timeout = aiohttp.ClientTimeout(
            total=self.request_timeout_s,
            sock_connect=self.connect_timeout_s,
            sock_read=self.first_byte_timeout_s,
        )
        last_error = "no healthy replica"
        unreachable = []
        for i, tier in enumerate(tiers):
            pool = self.balancer.tiers.get(tier)
            if pool is not None and pool.unreachable():
                unreachable.append(pool)  # across a WAN that is down: not even tried
                continue
            limit, held = self.max_attempts, False
            while pool is not None:
                while len(outcome.attempts) < limit:
                    replica = pool.pick(key, tried)
                    if replica is None:
                        break
                    done, last_error = await self._try(
                        request, replica, path, payload, headers, timeout, stream, t_start,
                        outcome, tried,
                    )  # fmt: skip
                    if done is not None:
                        return done, outcome
                    if outcome.status and outcome.status not in RETRYABLE_STATUS:
                        return None, outcome  # a 4xx/200 non-stream body, passed through
                    if outcome.unsent and len(pool.replicas) == 1 and i + 1 == len(tiers):
                        # One address for the tier is a Service: a refused connection means
                        # one of its pods just left (its endpoint not yet removed), not the
                        # tier. The request never left, and no other tier is left to try:
                        # the address again, after a beat.
                        tried.discard(replica.url)
                        await asyncio.sleep(SERVICE_RETRY_S * len(outcome.attempts))
                if held or not pool.scale_from_zero or outcome.tier != tier or outcome.status:
                    break
                # No replica of a tier that may be at zero answered at all: count it (the
                # autoscaler wakes the pool on it), and if no other tier is left, wait for
                # a replica to come up.
                self.metrics.cold.labels(tier=tier).inc()
                if i + 1 < len(tiers):
                    break
                await self._hold(tier, pool)
                held = True
                tried.difference_update(r.url for r in pool.replicas)
                limit = len(outcome.attempts) + self.max_attempts
        if unreachable and not outcome.attempts:
            pool = unreachable[0]
            since = time.monotonic() - min(
                r.unreachable_since for r in pool.replicas if r.unreachable
            )
            raise APIError(
                oai.TIER_UNREACHABLE,
                f"the {pool.name} tier is unreachable from this gateway: none of its "
                f"{len(pool.replicas)} backend(s) has answered a probe for {since:.0f} s",
                headers={"Retry-After": str(RETRY_UNREACHABLE_S)},
            )
        if outcome.attempts and outcome.busy == len(outcome.attempts):
            raise APIError(
                oai.SERVER_OVERLOADED,
                f"every replica of tier(s) {'/'.join(tiers)} asked is busy "
                f"({len(outcome.attempts)} attempt(s)): {last_error}",
                headers={"Retry-After": outcome.retry_after},
            )
        raise APIError(
            oai.UPSTREAM_UNAVAILABLE,
            f"no replica of tier(s) {'/'.join(tiers)} answered after {len(outcome.attempts)} "
            f"attempt(s): {last_error}",
        )

    async def _try(
        self,
        request: web.Request,
        replica: balancer_mod.Replica,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        stream: bool,
        t_start: float,
        outcome: Outcome,
        tried: set[str],
    ) -> tuple[web.StreamResponse | None, str]:
        """One attempt on one replica, counted in its outstanding requests."""
        headers = self.headers_for(replica, headers)
        tried.add(replica.url)
        outcome.attempts.append(replica.url)
        outcome.tier, outcome.unsent = replica.tier, False
        outcome.revision = replica.revision
        replica.num_outstanding += 1
        outcome.replica, outcome.load = replica.url, replica.num_outstanding
        outcome.sent_s = time.perf_counter() - t_start
        gauge = self.metrics.outstanding.labels(tier=replica.tier)
        gauge.inc()
        raw = (
            stream
            and self.pool is not None
            and relay.supports(replica.url)
            and request.version == aiohttp.HttpVersion11
        )
        try:
            if raw:
                return await self._attempt_raw(
                    request, replica, path, payload, headers, t_start, outcome
                )
            return await self._attempt(
                request, replica, path, payload, headers, timeout, stream, t_start, outcome
            )
        finally:
            replica.num_outstanding -= 1
            gauge.dec()

    async def _hold(self, tier: str, pool: balancer_mod.TierPool) -> None:
        """Wait until a replica of a tier at zero answers its health check (the autoscaler
        starts one when it sees requests waiting); 503 with Retry-After when the queue is
        full or none comes up within ``hold_timeout_s``."""
        if self._held.get(tier, 0) >= self.max_held_requests:
            raise APIError(
                oai.SERVER_OVERLOADED,
                f"tier {tier!r} has no replica yet and {self.max_held_requests} requests "
                "already wait for one; retry later",
                headers={"Retry-After": "10"},
            )
        waker = self._wakers.get(tier)
        if waker is None or waker.done():
            waker = asyncio.get_running_loop().create_task(self._wait_healthy(pool))
            self._wakers[tier] = waker
        gauge = self.metrics.held.labels(tier=tier)
        gauge.inc()
        self._held[tier] = self._held.get(tier, 0) + 1
        try:
            async with asyncio.timeout(self.hold_timeout_s):
                await asyncio.shield(waker)
        except TimeoutError:
            raise APIError(
                oai.SERVER_OVERLOADED,
                f"tier {tier!r} is scaled to zero and no replica became ready within "
                f"{self.hold_timeout_s:.0f} s; retry later",
                headers={"Retry-After": "30"},
            ) from None
        finally:
            gauge.dec()
            self._held[tier] -= 1
            if not self._held[tier] and not waker.done():
                waker.cancel()  # nobody waits any more: stop asking
        for replica in pool.replicas:  # what failed while it was at zero is not held against it
            self.balancer.record_success(replica)
            replica.ejected_until = 0.0

    async def _wait_healthy(self, pool: balancer_mod.TierPool) -> bool:
        """Poll the tier's backends' /health until one answers 200."""
        timeout = aiohttp.ClientTimeout(total=2.0)
        while True:
            for replica in pool.replicas:
                try:
                    async with self.session.get(replica.url + "/health", timeout=timeout) as r:
                        if r.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass
            await asyncio.sleep(HOLD_POLL_S)

    async def _attempt(
        self,
        request: web.Request,
        replica: balancer_mod.Replica,
        path: str,
        payload: bytes,
        headers: dict[str, str],
        timeout: aiohttp.ClientTimeout,
        stream: bool,
        t_start: float,
        outcome: Outcome,
    ) -> tuple[web.StreamResponse | None, str]:
        url = replica.url + path
        t_send = time.perf_counter()
        pre_s = t_send - t_start
        for fresh in (False, True):
            try:
                resp = await self.session.post(url, data=payload, headers=headers, timeout=timeout)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if not fresh and _stale_connection(exc):
                    # A pooled keep-alive connection the replica closed while it was idle
                    # (a replica shutting down closes its idle connections): the request
                    # never reached it. Once more, on a new connection.
                    log.debug("pooled connection to %s was closed while idle: %s", url, exc)
                    continue
                self._fail(replica, "connect")
                outcome.status, outcome.unsent = 0, True
                return None, _fault(replica, f"could not connect ({type(exc).__name__})", exc)
            break
        self.metrics.upstream_latency.labels(tier=replica.tier).observe(
            time.perf_counter() - t_send
        )
        try:
            if resp.status in RETRYABLE_STATUS:
                text = await resp.content.read(ERROR_DETAIL_BYTES)
                self._refused(replica, resp.status, resp.headers.get("Retry-After"), outcome)
                resp.close()
                return None, _fault(replica, f"answered HTTP {resp.status}", text)
            if not stream or resp.status != 200:
                body = await _read_capped(resp, self.max_body_bytes)
                self.balancer.record_success(replica)
                outcome.status, outcome.body = resp.status, body
                outcome.headers = {k.lower(): v for k, v in resp.headers.items()}
                outcome.ttft_s = time.perf_counter() - t_start
                outcome.added_s = pre_s
                return None, ""
            first = await resp.content.readany()
            if not first:
                self._fail(replica, "empty_stream")
                outcome.status = 0
                resp.close()
                return None, _fault(replica, "stream closed before the first byte")
        except relay.UpstreamError as exc:
            self._fail(replica, "malformed")
            outcome.status = 0
            resp.close()
            return None, _fault(replica, exc.fault, exc)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._fail(replica, "read")
            outcome.status = 0
            resp.close()
            return None, _fault(replica, f"failed while answering ({type(exc).__name__})", exc)
        except BaseException:
            resp.close()
            raise
        self.balancer.record_success(replica)
        outcome.status = 200
        return await self._relay(request, resp, first, replica, pre_s, t_start, outcome), ""

    async def _relay(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        first: bytes,
        replica: balancer_mod.Replica,
        pre_s: float,
        t_start: float,
        outcome: Outcome,
    ) -> web.StreamResponse:
        t_first = time.perf_counter()
        out = _sse_response(request, replica)
        completed = False
        try:
            await out.prepare(request)
            await out.write(first)
            outcome.ttft_s = time.perf_counter() - t_start
            outcome.added_s = pre_s + (time.perf_counter() - t_first)
            outcome.num_chunks = token_events(first)
            async for chunk in resp.content.iter_any():
                outcome.num_chunks += token_events(chunk)
                outcome.delivered = b"data: [DONE]" in chunk  # a client may close now
                await out.write(chunk)
            completed = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("upstream %s broke mid-stream: %s", replica.url, exc)
            self._fail(replica, "mid_stream")
            outcome.broken = True
            try:  # every write re-framed by aiohttp: always at a chunk boundary
                await out.write(stream_error_event(replica))
                completed = True
            except (ConnectionResetError, RuntimeError):
                pass
        except (ConnectionResetError, RuntimeError) as exc:
            log.info("client went away mid-stream (%s); closing upstream %s", exc, replica.url)
        finally:
            if completed:
                resp.release()
            else:
                resp.close()
        if completed and not outcome.broken:
            outcome.delivered = True  # every byte written: the rest is the terminator
        if completed:
            await _finish(out)
        return out

    # -- the raw streaming path (relay.py): no aiohttp client, bytes written from callbacks
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
        replica.url + path
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
                    return None, _fault(replica, f"could not connect ({type(exc).__name__})", exc)
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
                return None, _fault(
                    replica, _lost(conn.lost) + " before the answer's head", conn.lost
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
                    return None, _fault(
                        replica, _lost(conn.lost) + f" in its HTTP {head.status} answer", conn.lost
                    )
                body = conn.payload()
                if head.status in RETRYABLE_STATUS:
                    retry_after = head.headers.get("retry-after")
                    self._refused(replica, head.status, retry_after, outcome)
                    conn.abort()
                    return None, _fault(
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
                fault = _lost(conn.lost) if conn.lost is not None else "closed the stream"
                return None, _fault(replica, fault + " before the first byte", conn.lost or "")
        except TimeoutError:
            if conn is not None:
                conn.abort()
            self._fail(replica, "read")
            outcome.status = 0
            return None, _fault(replica, f"no answer within {self.first_byte_timeout_s:g} s")
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
        out = _sse_response(request, replica)
        out.enable_chunked_encoding()
        down = request.transport
        framed = conn.scanner is not None  # upstream chunks pass through as framed
        gone = False
        try:
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
        await _finish(out)
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


def _stale_connection(exc: BaseException) -> bool:
    """A reused connection found closed (not a replica that refuses connections)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(
        exc, aiohttp.ClientConnectorError
    )


ERROR_DETAIL_BYTES = 200  # of an upstream's error answer, kept for the gateway's log


def _fault(replica: balancer_mod.Replica, fault: str, detail: object = "") -> str:
    """What a client may read of a failed attempt (the tier and what went wrong), after
    logging it whole for the operator (the replica's address, the upstream's bytes)."""
    log.info("attempt on %s (%s tier) failed: %s%s", replica.url, replica.tier, fault,
             f" ({detail!r})" if detail else "")  # fmt: skip
    return (
        f"the {replica.tier} replica {fault}"
        if not fault.startswith("answer")
        else (f"the {replica.tier} replica's {fault}")
    )


def _lost(exc: BaseException | None) -> str:
    if isinstance(exc, relay.UpstreamError):
        return f"sent a malformed answer ({exc.fault})"
    return "closed the connection"


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """A whole answer, refused past ``cap`` bytes (announced or read)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise relay.UpstreamError(f"answer is over {cap} bytes")
    body = bytearray()
    while chunk := await resp.content.readany():
        body += chunk
        if len(body) > cap:
            raise relay.UpstreamError(f"answer is over {cap} bytes")
    return bytes(body)


def usage_tokens(body: bytes | None) -> int:
    import json

    if not body:
        return 0
    try:
        usage: dict[str, Any] = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError) as exc:
        log.debug("answer has no readable usage: %s", exc)
        return 0
    return int(usage.get("completion_tokens") or 0)


def stream_error_event(replica: balancer_mod.Replica) -> bytes:
    """What a client reads when the replica streaming its answer dies mid-way: an SSE error
    event in the OpenAI shape (the openai SDK raises it) and ``[DONE]``, never a stream that
    just ends as if the answer were complete. The leading blank line ends any event the
    replica had half-written."""
    _, body = oai.make_error(
        oai.UPSTREAM_UNAVAILABLE,
        f"the {replica.tier} replica streaming this answer failed mid-stream; the tokens "
        "received so far are not a complete answer: retry the request",
    )
    return b"\n\ndata: " + json.dumps(body.model_dump()).encode() + b"\n\ndata: [DONE]\n\n"


def _sse_response(request: web.Request, replica: balancer_mod.Replica) -> web.StreamResponse:
    """The client-side response of a stream, tagged with where it was routed."""
    return web.StreamResponse(
        status=200,
        headers={
            "content-type": "text/event-stream",
            "cache-control": "no-cache",
            "x-hybridllm-tier": replica.tier,
            "x-hybridllm-route": request.get(router.ROUTE_REASON, ""),
        },
    )


async def _finish(out: web.StreamResponse) -> None:
    """The stream's last chunk. A client that read the whole answer (``data: [DONE]``
    included) may close before the chunked terminator reaches it: the answer is complete
    and counted as such, not lost to the error the closed socket raises here."""
    with contextlib.suppress(ConnectionResetError, RuntimeError):
        await out.write_eof()
