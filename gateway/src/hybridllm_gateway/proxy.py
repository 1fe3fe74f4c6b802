"""Forwarding one request: replica attempts, retries before the first byte, streaming.

An attempt fails when the connection cannot be made, the upstream answers 5xx, or it
sends no first byte within ``first_byte_timeout_s``; then the replica is charged a failure
(see the balancer's ejection) and the next replica is tried, in this tier and then in the
route's next tier, up to ``max_attempts``. Once the first byte is in hand the answer is
committed. Streams from plain-http replicas take the raw path (``rawpath.py`` over
``relay.py``'s connections: upstream bytes written to the client from the upstream's
``data_received``, reading paused while the client's socket is full); others, and
non-streaming answers, go through aiohttp's client (``clientpath.py``: ``iter_any`` and
``write``, whose drain also gives backpressure). A 4xx is passed through as the runtime
wrote it. A client that goes away cancels the handler (aiohttp ``handler_cancellation``)
or is seen closed at the next write; either way the upstream connection is closed, not
drained, so the runtime sees the disconnect and stops generating.

Here: the ``Forwarder``'s attempt loop across replicas and tiers (``forward``), the
choice of path for one attempt (``_try``) and the hold for a tier at zero (``_hold``). The
two paths are mixed into the Forwarder; what they share (``Outcome``, what the forwarding
did; charging a failed attempt to its replica, a stream's token events, the error event of
a stream that breaks) is in ``attempt.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import metrics as metrics_mod
from hybridllm_gateway import relay
from hybridllm_gateway.attempt import RETRYABLE_STATUS, Outcome
from hybridllm_gateway.clientpath import ClientPath
from hybridllm_gateway.errors import APIError
from hybridllm_gateway.rawpath import RawPath
from hybridllm_gateway.router import TIER_HEADER

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.5  # how often a tier at zero is asked whether a replica is up
SERVICE_RETRY_S = 0.25  # the pause before trying a Service address again, times attempts
RETRY_UNREACHABLE_S = 5  # Retry-After of a request refused because its tier is unreachable


@dataclass
class Forwarder(ClientPath, RawPath):
    """Runs a request's attempts across its route's tiers (``forward``), each on the path
    that suits it (``_try``: ``clientpath.py`` or ``rawpath.py``), and holds a request for a
    tier at zero until a replica is up (``_hold``)."""

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
        shown it: it would open every runtime of the service). A remote tier's backend is a
        gateway across the WAN (a site's cloud tier): it is told the tier this gateway chose
        (``x-hybridllm-tier``), or its own router could send the request back to an edge."""
        base = dict(headers or {})
        if replica.remote:
            base[TIER_HEADER] = replica.tier
        return base if replica.device else {**base, **self.backend_headers}

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
        # a tier across a WAN that is down: not tried, or given up while the request waited
        down = unreachable or [
            p for t in tiers if (p := self.balancer.tiers.get(t)) is not None and p.unreachable()
        ]
        if down and not outcome.status and not outcome.busy:
            pool = down[0]
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
        outcome.sent_to = replica
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
                attempt = self._attempt_raw(
                    request, replica, path, payload, headers, t_start, outcome
                )
            else:
                attempt = self._attempt(
                    request, replica, path, payload, headers, timeout, stream, t_start, outcome
                )
            if replica.remote:
                return await self._unless_lost(replica, attempt, outcome)
            return await attempt
        finally:
            replica.num_outstanding -= 1
            gauge.dec()

    async def _unless_lost(
        self,
        replica: balancer_mod.Replica,
        attempt: Coroutine[Any, Any, tuple[web.StreamResponse | None, str]],
        outcome: Outcome,
    ) -> tuple[web.StreamResponse | None, str]:
        """An attempt on a backend across a WAN, given up when the probes find that backend
        unreachable before its answer has begun: a request in flight when the WAN drops
        fails fast (tier_unreachable) instead of waiting out its first-byte timeout. An
        answer already streaming to the client is left to finish or break by itself."""
        task = asyncio.ensure_future(attempt)
        lost = asyncio.ensure_future(replica.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() or outcome.started:
                return await task
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None, f"{replica.url}: its probes stopped answering while this request waited"
        finally:
            lost.cancel()
            if not task.done():  # the handler itself was cancelled (the client left)
                task.cancel()

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
                    async with self.session.get(replica.url + "/health", timeout=timeout,
                                                **replica.connect) as r:  # fmt: skip
                        if r.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError, OSError):
                    pass
            await asyncio.sleep(HOLD_POLL_S)


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
