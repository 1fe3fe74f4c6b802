"""An attempt through aiohttp's client: non-streaming answers, and streams the raw path
(``rawpath.py``) does not take (replicas over https, HTTP/1.0 clients, no relay pool).

A connection that cannot be made, a 5xx, or no first byte within ``first_byte_timeout_s``
(the client's ``sock_read``) fails the attempt; a pooled keep-alive connection found closed
is retried once on a new one. A stream is relayed with ``iter_any`` and ``write``, whose
drain gives backpressure; a client gone mid-way closes the upstream connection, not drains
it. Mixed into ``proxy.Forwarder``.
"""

from __future__ import annotations

import logging
import time

import aiohttp
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
    report_fault,
    sse_response,
    stream_error_event,
    token_events,
)

log = logging.getLogger("hybridllm_gateway.proxy")  # the forwarding's log, as before the split


class ClientPath(Attempts):
    """The attempt and the stream relay through ``self.session``."""

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
                resp = await self.session.post(url, data=payload, headers=headers, timeout=timeout,
                                               **replica.connect)  # fmt: skip
            except aiohttp.ClientConnectorCertificateError as exc:
                self._fail(replica, "tls")  # not the device it should be (or no TLS at all)
                outcome.status, outcome.unsent = 0, True
                return None, report_fault(replica, "failed its TLS certificate check", exc)
            except aiohttp.SocketTimeoutError:
                # connected and sent, but no head within the first-byte timeout: the replica
                # has the request (not "unsent": the same address is not asked again)
                self._fail(replica, names.UpstreamErrorKind.TIMEOUT)
                outcome.status = 0
                return None, report_fault(
                    replica, f"no answer within {self.first_byte_timeout_s:g} s"
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                if not fresh and _stale_connection(exc):
                    # A pooled keep-alive connection the replica closed while it was idle
                    # (a replica shutting down closes its idle connections): the request
                    # never reached it. Once more, on a new connection.
                    log.debug("pooled connection to %s was closed while idle: %s", url, exc)
                    continue
                self._fail(replica, "connect")
                outcome.status, outcome.unsent = 0, True
                return None, report_fault(replica, f"could not connect ({type(exc).__name__})", exc)
            break
        self.metrics.upstream_latency.labels(tier=replica.tier).observe(
            time.perf_counter() - t_send
        )
        try:
            if resp.status in RETRYABLE_STATUS:
                text = await resp.content.read(ERROR_DETAIL_BYTES)
                self._refused(replica, resp.status, resp.headers.get("Retry-After"), outcome)
                resp.close()
                return None, report_fault(replica, f"answered HTTP {resp.status}", text)
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
                return None, report_fault(replica, "stream closed before the first byte")
        except relay.UpstreamError as exc:
            self._fail(replica, "malformed")
            outcome.status = 0
            resp.close()
            return None, report_fault(replica, exc.fault, exc)
        except TimeoutError:
            self._fail(replica, names.UpstreamErrorKind.TIMEOUT)
            outcome.status = 0
            resp.close()
            return None, report_fault(replica, f"no answer within {self.first_byte_timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            self._fail(replica, "read")
            outcome.status = 0
            resp.close()
            return None, report_fault(
                replica, f"failed while answering ({type(exc).__name__})", exc
            )
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
        out = sse_response(request, replica)
        completed = False
        try:
            outcome.started = True
            await out.prepare(request)
            await out.write(first)
            outcome.ttft_s = time.perf_counter() - t_start
            outcome.first_token(replica)
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
            await finish_stream(out)
        return out


def _stale_connection(exc: BaseException) -> bool:
    """A reused connection found closed (not a replica that refuses connections)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(
        exc, aiohttp.ClientConnectorError
    )


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
