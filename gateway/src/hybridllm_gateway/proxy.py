"""Forwarding one request: replica attempts, retries before the first byte, streaming.

An attempt fails when the connection cannot be made, the upstream answers 5xx, or it
sends no first byte within ``first_byte_timeout_s``; then the replica is charged a failure
(see the balancer's ejection) and the next replica is tried, in this tier and then in the
route's next tier, up to ``max_attempts``. Once the first byte is in hand the answer is
committed: a stream is relayed chunk by chunk, each write awaiting the client's socket
(backpressure: a slow client slows the upstream read, nothing piles up in the gateway);
a 4xx is passed through as the runtime wrote it. A client that goes away cancels the
handler (aiohttp ``handler_cancellation``) or fails the next write; either way the
upstream response is closed, not drained, so the runtime sees the disconnect and stops
generating.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import metrics as metrics_mod
from hybridllm_gateway.errors import APIError

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


@dataclass
class Outcome:
    """What the forwarding did, for metrics, the token bucket and the cascade."""

    tier: str = ""
    status: int = 0
    num_chunks: int = 0
    body: bytes | None = None  # non-streaming answers only
    headers: dict[str, str] = field(default_factory=dict)
    added_s: float = 0.0
    ttft_s: float = 0.0
    attempts: list[str] = field(default_factory=list)


@dataclass
class Forwarder:
    session: aiohttp.ClientSession
    balancer: balancer_mod.Balancer
    metrics: metrics_mod.GatewayMetrics
    connect_timeout_s: float
    first_byte_timeout_s: float
    request_timeout_s: float
    max_attempts: int

    def _fail(self, replica: balancer_mod.Replica, kind: str) -> None:
        self.metrics.upstream_errors.labels(tier=replica.tier, kind=kind).inc()
        if self.balancer.record_failure(replica):
            self.metrics.ejections.labels(tier=replica.tier).inc()
            log.warning("ejected %s (%s tier) after repeated failures", replica.url, replica.tier)

    async def forward(
        self,
        request: web.Request,
        path: str,
        payload: bytes,
        tiers: tuple[str, ...],
        key: str | None,
        stream: bool,
        t_start: float,
    ) -> tuple[web.StreamResponse | None, Outcome]:
        """Sends the request; for a stream, writes the answer and returns the response."""
        outcome = Outcome()
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
        for tier in tiers:
            pool = self.balancer.tiers.get(tier)
            while pool is not None and len(outcome.attempts) < self.max_attempts:
                replica = pool.pick(key, tried)
                if replica is None:
                    break
                tried.add(replica.url)
                outcome.attempts.append(replica.url)
                outcome.tier = tier
                replica.num_outstanding += 1
                gauge = self.metrics.outstanding.labels(tier=tier)
                gauge.inc()
                try:
                    done, last_error = await self._attempt(
                        request, replica, path, payload, headers, timeout, stream, t_start, outcome
                    )
                finally:
                    replica.num_outstanding -= 1
                    gauge.dec()
                if done is not None:
                    return done, outcome
                if outcome.status and outcome.status not in RETRYABLE_STATUS:
                    return None, outcome  # a 4xx/200 non-stream body, passed through
        raise APIError(
            oai.UPSTREAM_UNAVAILABLE,
            f"no replica of tier(s) {'/'.join(tiers)} answered after {len(outcome.attempts)} "
            f"attempt(s): {last_error}",
        )

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
        try:
            resp = await self.session.post(url, data=payload, headers=headers, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._fail(replica, "connect")
            outcome.status = 0
            return None, f"{url}: {type(exc).__name__}: {exc}"
        self.metrics.upstream_latency.labels(tier=replica.tier).observe(
            time.perf_counter() - t_send
        )
        try:
            if resp.status in RETRYABLE_STATUS:
                text = await resp.text(errors="replace")
                self._fail(replica, f"http_{resp.status}")
                outcome.status = resp.status
                resp.close()
                return None, f"{url}: HTTP {resp.status}: {text[:200]}"
            if not stream or resp.status != 200:
                body = await resp.read()
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
                return None, f"{url}: stream closed before the first byte"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._fail(replica, "read")
            outcome.status = 0
            resp.close()
            return None, f"{url}: {type(exc).__name__}: {exc}"
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
        out = web.StreamResponse(
            status=200,
            headers={
                "content-type": "text/event-stream",
                "cache-control": "no-cache",
                "x-hybridllm-tier": replica.tier,
                "x-hybridllm-route": request.get("route_reason", ""),
            },
        )
        completed = False
        try:
            await out.prepare(request)
            await out.write(first)
            outcome.ttft_s = time.perf_counter() - t_start
            outcome.added_s = pre_s + (time.perf_counter() - t_first)
            outcome.num_chunks = first.count(b"data: ")
            async for chunk in resp.content.iter_any():
                outcome.num_chunks += chunk.count(b"data: ")
                await out.write(chunk)
            completed = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("upstream %s broke mid-stream: %s", replica.url, exc)
            self._fail(replica, "mid_stream")
        except (ConnectionResetError, RuntimeError) as exc:
            log.info("client went away mid-stream (%s); closing upstream %s", exc, replica.url)
        finally:
            if completed:
                resp.release()
            else:
                resp.close()
        if completed:
            await out.write_eof()
        return out


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
