"""Cascade: re-ask the cloud when the edge's answer is not confident (non-streaming only).

The confidence signal is the answer's mean token logprob. The gateway asks the edge for
logprobs (``logprobs: true`` on chat, ``logprobs: 1`` on completions) and reads, in order:

1. the response header ``x-hybridllm-mean-logprob`` (a float), when the runtime sends it;
2. ``usage.mean_logprob``, when the runtime puts it there;
3. the mean of the per-token logprobs of choice 0 (``logprobs.content[].logprob`` for
   chat, ``logprobs.token_logprobs`` for completions).

Under ``cascade.minMeanLogprob`` the request is sent again, unchanged, to the cloud tier,
and the cloud's answer is returned (route reason ``cascade``). An answer that carries no
signal is kept and logged. Logprobs the client did not ask for are removed from the edge
answer before it is returned.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from aiohttp import web

from hybridllm_gateway import attempt, proxy, router
from hybridllm_gateway import metrics as metrics_mod

log = logging.getLogger(__name__)

MEAN_LOGPROB_HEADER = "x-hybridllm-mean-logprob"


def mean_logprob(headers: dict[str, str], answer: dict[str, Any]) -> float | None:
    raw = headers.get(MEAN_LOGPROB_HEADER)
    if raw is not None:
        try:
            return float(raw)
        except ValueError:
            log.warning("ignoring unreadable %s header %r", MEAN_LOGPROB_HEADER, raw)
    usage = answer.get("usage") or {}
    if isinstance(usage.get("mean_logprob"), int | float):
        return float(usage["mean_logprob"])
    choices = answer.get("choices") or []
    if not choices:
        return None
    lp = choices[0].get("logprobs") or {}
    values: list[float] = []
    if isinstance(lp.get("content"), list):
        values = [t["logprob"] for t in lp["content"] if isinstance(t.get("logprob"), int | float)]
    elif isinstance(lp.get("token_logprobs"), list):
        values = [v for v in lp["token_logprobs"] if isinstance(v, int | float)]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else None


async def run(
    forwarder: proxy.Forwarder,
    metrics: metrics_mod.GatewayMetrics,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    route: router.Route,
    key: str | None,
    t_start: float,
    threshold: float,
    prompt_tokens: int,
) -> attempt.Outcome:
    chat = path.endswith("chat/completions")
    asked = body.get("logprobs")
    edge_body = dict(body)
    edge_body["logprobs"] = True if chat else max(int(asked or 0), 1)
    _, outcome = await forwarder.forward(
        request, path, json.dumps(edge_body).encode(), route.tiers, key, False, t_start
    )
    if outcome.tier != "edge" or outcome.status != 200 or not outcome.body:
        return outcome
    answer = json.loads(outcome.body)
    confidence = mean_logprob(outcome.headers, answer)
    if confidence is None:
        log.info("edge answer carries no confidence signal; keeping it")
    elif confidence < threshold:
        metrics.cascades.inc()
        request[router.ROUTE_REASON] = "cascade"
        metrics.decisions.labels(tier="cloud", reason="cascade").inc()
        metrics.offered.offer("cloud", prompt_tokens, metrics_mod.completion_cap(body))
        _, cloud = await forwarder.forward(
            request, path, json.dumps(body).encode(), ("cloud",), key, False, t_start
        )
        return cloud
    if not asked:
        for choice in answer.get("choices") or []:
            choice["logprobs"] = None
        outcome.body = json.dumps(answer).encode()
    return outcome
