"""One attempt on one replica: what its two paths share.

``proxy.Forwarder`` runs the attempts (across replicas and tiers, with the retries and the
hold for a tier at zero); it is made of the two paths an attempt takes, mixed in:
``clientpath.ClientPath`` (aiohttp's client: non-streaming answers, and streams from
replicas the raw path does not serve) and ``rawpath.RawPath`` (streams from plain-http
replicas over ``relay.py``'s connections). Both build on ``Attempts`` here: the
Forwarder's settings they read, and how a failed or refused attempt is charged to its
replica (the balancer's ejection, the metrics), and ``Outcome``, what the forwarding did
(for the metrics, the token bucket and the cascade). Also here: the helpers of both paths (the
stream's token events, its client-side response and its end, the error event of a stream
that breaks, what a client may read of a failed attempt).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import metrics as metrics_mod
from hybridllm_gateway import relay, router

log = logging.getLogger("hybridllm_gateway.proxy")  # the forwarding's log, as before the split

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
ERROR_DETAIL_BYTES = 200  # of an upstream's error answer, kept for the gateway's log


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
    num_chunks: int = 0  # a streamed answer's token events (see attempt.token_events)
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
    started: bool = False  # the answer to the client has begun (its headers are going out)
    prompt_tokens: int = 0  # the request's, as the gateway counts them (set by the caller)
    sent_to: balancer_mod.Replica | None = None  # the replica of the last attempt
    stall_mark: int = 0  # its prompt_tokens_prefilled once this answer's first token came

    def first_token(self, replica: balancer_mod.Replica) -> None:
        """The streamed answer's first token is here: its prompt is prefilled."""
        replica.prompt_tokens_prefilled += self.prompt_tokens
        self.stall_mark = replica.prompt_tokens_prefilled

    @property
    def stalled_tokens(self) -> int:
        """Prompt tokens of other answers the replica prefilled (their first tokens came)
        between this answer's first token and its last."""
        return self.sent_to.prompt_tokens_prefilled - self.stall_mark if self.sent_to else 0


class Attempts:
    """What both attempt paths use of ``proxy.Forwarder`` (its dataclass fields), and the
    charging of a failed attempt to its replica."""

    session: aiohttp.ClientSession
    balancer: balancer_mod.Balancer
    metrics: metrics_mod.GatewayMetrics
    first_byte_timeout_s: float
    request_timeout_s: float
    pool: relay.Pool | None
    max_body_bytes: int

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


def report_fault(replica: balancer_mod.Replica, fault: str, detail: object = "") -> str:
    """What a client may read of a failed attempt (the tier and what went wrong), after
    logging it whole for the operator (the replica's address, the upstream's bytes)."""
    log.info("attempt on %s (%s tier) failed: %s%s", replica.url, replica.tier, fault,
             f" ({detail!r})" if detail else "")  # fmt: skip
    return (
        f"the {replica.tier} replica {fault}"
        if not fault.startswith("answer")
        else (f"the {replica.tier} replica's {fault}")
    )


def lost_reason(exc: BaseException | None) -> str:
    if isinstance(exc, relay.UpstreamError):
        return f"sent a malformed answer ({exc.fault})"
    return "closed the connection"


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


def sse_response(request: web.Request, replica: balancer_mod.Replica) -> web.StreamResponse:
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


async def finish_stream(out: web.StreamResponse) -> None:
    """The stream's last chunk. A client that read the whole answer (``data: [DONE]``
    included) may close before the chunked terminator reaches it: the answer is complete
    and counted as such, not lost to the error the closed socket raises here."""
    with contextlib.suppress(ConnectionResetError, RuntimeError):
        await out.write_eof()
