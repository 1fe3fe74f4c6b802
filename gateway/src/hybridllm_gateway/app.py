"""The gateway's aiohttp application: ``create_app(settings)``, state set up on startup.

Why aiohttp and not FastAPI/uvicorn + httpx (the runtimes' stack): the gateway's hot
path is "read a body, decide, relay bytes", and the seeds show a FastAPI gateway falling
behind its engine at 64-256 concurrent streams. aiohttp gives the server and the
pooled upstream client on one event loop with C HTTP parsers, no ASGI layer between, and
uvloop under it; the OpenAI models of ``hybridllm_common`` still validate every request,
so errors have the runtimes' shape (``{"error": {...}}``, stable codes). The measured
result is in ``bench/results/gateway.md``.

Request flow: size bound -> API key -> JSON + OpenAI validation -> ``max_tokens`` bound ->
model name (``name:edge`` suffix) -> content filter -> rate limit -> tier (router) ->
replica and forwarding (proxy) -> metrics and token accounting. The body is re-encoded
only when the gateway changed it (suffix stripped, redaction, cascade); otherwise the
client's bytes go upstream as they came.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from hybridllm_common import backend_auth, speed
from hybridllm_common import openai_protocol as oai
from hybridllm_gateway import attempt, golden, openapi, probe, proxy, relay, router, safety
from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import cascade as cascade_mod
from hybridllm_gateway import classifier as classifier_mod
from hybridllm_gateway import config as config_mod
from hybridllm_gateway import metrics as metrics_mod
from hybridllm_gateway.errors import APIError, error_response

log = logging.getLogger(__name__)


@dataclass
class State:
    settings: config_mod.GatewaySettings
    routing: config_mod.RoutingConfig
    balancer: balancer_mod.Balancer
    classifier: classifier_mod.Classifier
    keys: safety.ApiKeys
    limiter: safety.RateLimiter
    filter: safety.ContentFilter
    metrics: metrics_mod.GatewayMetrics
    # sent to every backend (hybridllm_common.backend_auth): empty where none is configured
    backend_headers: dict[str, str] = field(default_factory=dict)
    forwarder: proxy.Forwarder | None = None
    watchers: list[config_mod.FileWatcher] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def set_routing(self, routing: config_mod.RoutingConfig) -> None:
        self.balancer.update(routing)
        self.limiter.update(routing.rate_limits)
        self.metrics.serve_tiers(self.balancer.tiers)
        self.metrics.serve_revisions(self.balancer.tiers)
        self.metrics.routing_generation.set(routing.generation)
        self.metrics.speeds.keep(
            {(name, r.url) for name, pool in self.balancer.tiers.items() for r in pool.replicas}
        )
        self.routing = routing


STATE = web.AppKey("state", State)


def new_state(settings: config_mod.GatewaySettings) -> State:
    routing = config_mod.load_routing(settings.config)
    state = State(
        settings=settings,
        routing=routing,
        balancer=balancer_mod.Balancer(settings),
        classifier=classifier_mod.Classifier.load(settings.classifier),
        keys=safety.ApiKeys.load(settings.api_keys_file),
        limiter=safety.RateLimiter(routing.rate_limits),
        filter=safety.ContentFilter.load(settings.filter_config),
        metrics=metrics_mod.GatewayMetrics(),
    )
    token = backend_auth.load_token()
    if token is not None:
        state.backend_headers = backend_auth.header(token)
    state.set_routing(routing)
    return state


def _reload_routing(state: State, path: Any) -> None:
    state.set_routing(config_mod.load_routing(path))
    state.metrics.reloads.inc()


def _watchers(state: State) -> list[config_mod.FileWatcher]:
    s = state.settings
    out = [
        config_mod.FileWatcher(s.config, lambda p: _reload_routing(state, p), s.reload_interval_s)
    ]
    if s.api_keys_file is not None:
        out.append(
            config_mod.FileWatcher(
                s.api_keys_file,
                lambda p: setattr(state, "keys", safety.ApiKeys.load(p)),
                s.reload_interval_s,
            )
        )
    if s.filter_config is not None:
        out.append(
            config_mod.FileWatcher(
                s.filter_config,
                lambda p: setattr(state, "filter", safety.ContentFilter.load(p)),
                s.reload_interval_s,
            )
        )
    return out


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except APIError as exc:
        request.app[STATE].metrics.rejected.labels(code=exc.code).inc()
        return _answered(request, error_response(exc.code, exc.message, exc.param, exc.headers))
    except web.HTTPException as exc:
        code = {404: oai.NOT_FOUND, 405: oai.METHOD_NOT_ALLOWED}.get(
            exc.status, oai.INVALID_REQUEST
        )
        _, body = oai.make_error(code, f"{request.method} {request.path[:200]}: {exc.reason}")
        return web.json_response(body.model_dump(), status=exc.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        # The exception's text stays in the log: it may hold addresses or upstream bytes.
        rid = request.headers.get("x-request-id", "")[:64]
        log.exception("request %s %s failed (x-request-id %r)", request.method, request.path, rid)
        return _answered(
            request,
            error_response(
                oai.INTERNAL_ERROR,
                f"internal error ({type(exc).__name__}); the gateway's log has the details"
                + (f" under x-request-id {rid}" if rid else ""),
            ),
        )


def _answered(request: web.Request, response: web.Response) -> web.Response:
    """An API request answered with an error: counted in requests_total with its status
    (a 502 for an upstream that failed, a 429 for a limit), under the tier it was routed
    to, so that error rates and burn-rate alerts see the errors the gateway answers."""
    tier = request.get(router.ROUTE_TIER)
    if tier is not None:
        request.app[STATE].metrics.requests.labels(tier=tier, code=str(response.status)).inc()
    return response


FILTER_INLINE_BYTES = 64 << 10  # bodies above this are filtered on a worker thread


def _validate(model_cls: type[BaseModel], body: Any) -> Any:
    """The request as the one request model parses it: every field's type is decided here,
    for the whole gateway (and the runtimes parse the same bytes with the same model)."""
    if not isinstance(body, dict):
        raise APIError(oai.INVALID_REQUEST, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = oai.validation_error_param(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        raise APIError(oai.INVALID_PARAMETER, msg, param) from None


def _affinity_key(state: State, request: web.Request, body: dict[str, Any]) -> str:
    aff = state.routing.session_affinity
    if aff.enabled:
        session = request.headers.get(aff.header) or body.get("user")
        if isinstance(session, str) and session:
            return "s:" + session
    return "p:" + classifier_mod.prompt_text(body)[: state.settings.prefix_chars]


async def _handle(
    request: web.Request, path: str, model_cls: type[BaseModel]
) -> web.StreamResponse:
    t_start = time.perf_counter()
    request[router.ROUTE_TIER] = "none"
    state = request.app[STATE]
    s = state.settings
    if (request.content_length or 0) > s.max_body_bytes:
        raise APIError(oai.INVALID_REQUEST, f"request body is over {s.max_body_bytes} bytes")
    raw = await request.read()
    if len(raw) > s.max_body_bytes:
        raise APIError(oai.INVALID_REQUEST, f"request body is over {s.max_body_bytes} bytes")
    key_name = state.keys.authenticate(
        request.headers.get("authorization"), request.headers.get("x-api-key")
    )
    if state.keys.hashes is None:  # no keys: limits apply per client address
        key_name = f"ip:{request.remote}"
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(oai.INVALID_REQUEST, f"the request body is not JSON: {exc}") from None
    parsed = _validate(model_cls, body)
    max_tokens = parsed.effective_max_tokens()
    if max_tokens is not None and max_tokens > s.max_tokens_limit:
        raise APIError(
            oai.INVALID_PARAMETER,
            f"max_tokens {max_tokens} is over this gateway's limit of {s.max_tokens_limit}",
            "max_tokens",
        )
    routing = state.routing
    model, suffix = router.split_model(str(body.get("model", "")))
    explicit = request.headers.get(router.TIER_HEADER) or suffix
    pools = state.balancer.tiers
    if explicit is not None and explicit not in pools:
        raise APIError(
            oai.INVALID_PARAMETER,
            f"tier {explicit!r} is not served here; tiers: {', '.join(sorted(pools))}",
            "model",
        )
    if routing.model and model and model != routing.model:
        raise APIError(
            oai.MODEL_NOT_FOUND, f"model {model!r} not found; this gateway serves {routing.model!r}"
        )
    changed = suffix is not None
    if changed:
        body["model"] = model
    if state.keys.hashes is not None and body.get("cache_salt") != key_name:
        # One prefix-cache partition per tenant: a client cannot pick another's salt.
        body["cache_salt"] = key_name
        changed = True
    # Admission before the content filter: a client over its limits costs no scan.
    features = classifier_mod.extract(body)
    reservation = state.limiter.admit(
        key_name, features.prompt_tokens, parsed.generation_cap(s.max_tokens_limit)
    )
    m = state.metrics
    stream = parsed.stream

    def account(outcome: attempt.Outcome, tokens: int) -> None:
        """The answer's metrics (synchronous: it runs in a cancelled handler too)."""
        m.requests.labels(tier=outcome.tier, code=str(outcome.status)).inc()
        if 200 <= outcome.status < 300:
            m.prompt_tokens.labels(tier=outcome.tier).inc(features.prompt_tokens)
            m.completion_tokens.labels(tier=outcome.tier).inc(tokens)
        m.added.observe(outcome.added_s)
        m.ttft.labels(tier=outcome.tier).observe(outcome.ttft_s)
        e2e_s = time.perf_counter() - t_start
        m.e2e.labels(tier=outcome.tier).observe(e2e_s)
        if outcome.status < 500 and not outcome.broken:
            m.revision_attempts.labels(
                tier=outcome.tier, revision=outcome.revision, result="ok"
            ).inc()
        if 200 <= outcome.status < 300 and not outcome.broken:
            m.offered.answered(outcome.tier, tokens)
            m.revision_ttft.labels(tier=outcome.tier, revision=outcome.revision).observe(
                outcome.ttft_s
            )
            if stream and tokens >= 2:  # a whole answer at once says nothing of token times
                m.revision_tpot.labels(tier=outcome.tier, revision=outcome.revision).observe(
                    (e2e_s - outcome.ttft_s) / (tokens - 1)
                )
            if stream and tokens >= 1 and outcome.replica:  # the replica's own times
                m.speeds.answered(outcome.tier, outcome.replica, speed.Answer(
                    load=outcome.load, prompt_tokens=features.prompt_tokens,
                    ttft_s=outcome.ttft_s - outcome.sent_s, output_tokens=tokens,
                    decode_s=e2e_s - outcome.ttft_s, stalled_tokens=outcome.stalled_tokens,
                ))  # fmt: skip
        reservation.settle(tokens)

    outcome = attempt.Outcome(prompt_tokens=features.prompt_tokens)
    try:
        if len(raw) > FILTER_INLINE_BYTES:  # linear, but a large body's scan is not the loop's
            found = await asyncio.get_running_loop().run_in_executor(None, state.filter.apply, body)
        else:
            found = state.filter.apply(body)
        if found:
            changed = True
        route = router.choose(routing, pools, state.classifier, features, explicit,
                              m.speeds.table, m.offered.mean)  # fmt: skip
        request[router.ROUTE_REASON] = route.reason
        request[router.ROUTE_TIER] = route.tiers[0]
        m.decisions.labels(tier=route.tiers[0], reason=route.reason).inc()
        m.kinds.labels(tier=route.tiers[0], kind=metrics_mod.request_kind(body)).inc()
        cap = metrics_mod.completion_cap(body)
        m.offered.offer(route.tiers[0], features.prompt_tokens, cap)
        key = _affinity_key(state, request, body)
        assert state.forwarder is not None
        if not stream and routing.cascade.enabled and route.tiers[0] == "edge":
            outcome = await cascade_mod.run(state.forwarder, m, request, path, body,
                                            route, key, t_start, routing.cascade.min_mean_logprob,
                                            features.prompt_tokens)  # fmt: skip
            response: web.StreamResponse | None = None
        else:
            payload = json.dumps(body).encode() if changed else raw
            response, outcome = await state.forwarder.forward(
                request, path, payload, route.tiers, key, stream, t_start, outcome
            )
    except asyncio.CancelledError:
        # the client closed its connection: after the whole answer (it had it all, as
        # clients do on the last byte), accounted as answered; else what was reserved
        # stays charged
        if outcome.delivered:
            account(outcome, outcome.num_chunks)
        raise
    except APIError as exc:
        reservation.settle(0)  # refused before any answer: nothing was generated
        first = pools.get(request.get(router.ROUTE_TIER, ""))
        if (
            exc.code == oai.TIER_UNREACHABLE and not outcome.attempts
            and first is not None and first.unreachable()
        ):  # fmt: skip
            # offered to a tier across a WAN that is down and never sent: the tier's own
            # gateways never see it (one sent before the cut they counted on its arrival)
            m.offered.strand(first.name, features.prompt_tokens, cap)
        raise
    except BaseException:
        reservation.settle(0)  # refused or failed before any answer: nothing was generated
        raise
    if response is None:
        response = web.Response(
            body=outcome.body,
            status=outcome.status,
            content_type="application/json",
            headers={
                "x-hybridllm-tier": outcome.tier,
                "x-hybridllm-route": request[router.ROUTE_REASON],
            },
        )
        account(outcome, proxy.usage_tokens(outcome.body))
    else:
        account(outcome, outcome.num_chunks)
    return response


async def chat(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "/v1/chat/completions", oai.ChatCompletionRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "/v1/completions", oai.CompletionRequest)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = state.routing.model or "default"
    cards = [oai.ModelCard(id=name)] + [
        oai.ModelCard(id=f"{name}:{t}") for t in sorted(state.balancer.tiers)
    ]
    return web.json_response(oai.ModelList(data=cards).model_dump())


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = {t: len(p.healthy()) for t, p in state.balancer.tiers.items()}
    if not any(healthy.values()):
        return error_response(oai.MODEL_NOT_READY, f"no healthy backend replica: {healthy}")
    return web.json_response({"status": "ok", "healthy_replicas": healthy})


async def readyz(request: web.Request) -> web.Response:
    """The gateway's own readiness (its pods' readiness probe): it takes requests whatever
    its backends' state, answering 503 with Retry-After when none is healthy or holding a
    request for a pool that scales from zero, and its /metrics keep the demand the
    autoscaler needs most then. A probe on /health would take the gateway out of its
    Service exactly when its backends are overloaded or at zero."""
    state = request.app[STATE]
    healthy = {t: len(p.healthy()) for t, p in state.balancer.tiers.items()}
    return web.json_response({"status": "ok", "healthy_replicas": healthy})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.serve_revisions(state.balancer.tiers)  # ejections change between reloads
    data = generate_latest(state.metrics.registry)
    return web.Response(body=data, headers={"content-type": CONTENT_TYPE_LATEST})


async def openapi_spec(request: web.Request) -> web.Response:
    return web.json_response(openapi.spec())


async def _startup(app: web.Application) -> None:
    state = app[STATE]
    s = state.settings
    connector = aiohttp.TCPConnector(
        limit=s.upstream_connections, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=10
    )
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    state.forwarder = proxy.Forwarder(
        session=session,
        backend_headers=state.backend_headers,
        balancer=state.balancer,
        metrics=state.metrics,
        connect_timeout_s=s.connect_timeout_s,
        first_byte_timeout_s=s.first_byte_timeout_s,
        request_timeout_s=s.request_timeout_s,
        max_attempts=s.max_attempts,
        pool=relay.Pool(s.connect_timeout_s, s.max_upstream_body_bytes)
        if s.stream_relay == "raw"
        else None,
        hold_timeout_s=s.hold_timeout_s,
        max_held_requests=s.max_held_requests,
        max_body_bytes=s.max_upstream_body_bytes,
    )
    state.watchers = _watchers(state)
    state.tasks = [asyncio.create_task(w.run()) for w in state.watchers]
    checker = golden.GoldenChecker(
        session, state.metrics, lambda: state.routing, state.backend_headers
    )
    state.tasks.append(asyncio.create_task(checker.run()))
    prober = probe.Prober(
        session, lambda: state.balancer.tiers, s, state.metrics, state.backend_headers
    )
    state.tasks.append(asyncio.create_task(prober.run()))
    # Everything alive now (modules, the classifier, the app, the event loop's and the
    # server's own objects) lives as long as the process: collected once, then out of the
    # collector's sight, so a full collection walks only request objects. (In steady
    # state at 256 streams collections are rare either way: bench/gateway/diagnostics.py.)
    gc.collect()
    gc.freeze()


async def _cleanup(app: web.Application) -> None:
    state = app[STATE]
    for task in state.tasks:
        task.cancel()
    await asyncio.gather(*state.tasks, return_exceptions=True)
    if state.forwarder is not None:
        await state.forwarder.session.close()
        if state.forwarder.pool is not None:
            state.forwarder.pool.close()


def create_app(settings: config_mod.GatewaySettings) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware], client_max_size=settings.max_body_bytes * 2
    )
    app[STATE] = new_state(settings)
    app.on_startup.append(_startup)
    app.on_cleanup.append(_cleanup)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_spec)
    return app
