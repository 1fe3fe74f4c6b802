"""FastAPI app factory: state on ``app.state`` from a lifespan handler, one error format.

``create_app(settings)`` loads the model in the lifespan handler (``/health`` answers 503
until it is loaded); tests pass a ready ``LLMEngine`` instead. Every error leaves as
``{"error": {"message", "type", "param", "code"}}`` with a stable code from
``hybridllm_common.openai_protocol``; request validation failures are 400s naming the
parameter.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridllm_cloud import config as config_mod
from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.disagg import connector, prefill_server, transport
from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.search import verifier as verifier_mod
from hybridllm_cloud.server import metrics as server_metrics
from hybridllm_cloud.server import search_api, serving
from hybridllm_common import backend_auth, http_errors, termination
from hybridllm_common import openai_protocol as oai

log = logging.getLogger(__name__)


APIError = oai.APIError


def resolve_model_path(model: str, verify: bool = True, sha256: str | None = None) -> Path:
    """A local HF-layout directory as is; anything else through the model store, its
    files re-hashed against the manifest when ``verify`` (a corrupt artifact raises
    ``hybridllm_models.IntegrityError``)."""
    path = Path(model)
    if path.is_dir():
        return path
    import hybridllm_models

    return Path(hybridllm_models.ensure(model, target="hf", verify=verify, expected_sha256=sha256))


def served_name(settings: config_mod.ServeSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if Path(settings.model).is_dir():
        return Path(settings.model).name
    return settings.model.rsplit("#", 1)[-1].split(".", 1)[0] or settings.model


def model_id(engine: llm_engine.LLMEngine, name: str) -> str:
    """Served name plus a fingerprint of the architecture: prefill and decode must agree."""
    digest = hashlib.sha256(repr(engine.model.config).encode()).hexdigest()[:12]
    return f"{name}:{digest}"


async def _start_role(
    app: FastAPI, settings: config_mod.ServeSettings, engine: llm_engine.LLMEngine
) -> Callable[[], Awaitable[None]]:
    """Starts what the role adds (KV server or prefill client); returns its shutdown."""
    metrics = app.state.metrics
    ident = model_id(engine, app.state.model_name)
    if settings.role == "prefill":
        server = prefill_server.KVServer(
            app.state.engine,
            ident,
            max_waiting=settings.max_waiting_requests,
            timeout=settings.kv_transfer_timeout_seconds,
            on_transfer=metrics.on_kv_served,
            token=backend_auth.load_token(),
        )
        endpoints = [transport.Endpoint("tcp", settings.host, settings.kv_port)]
        if settings.kv_socket:
            endpoints.append(transport.Endpoint("unix", settings.kv_socket))
        app.state.kv_endpoints = [await server.start(ep) for ep in endpoints]
        metrics.set_role("prefill", lambda: server.active)
        return server.close
    if settings.role == "decode":
        assert settings.prefill_url is not None
        client = connector.RemotePrefillClient(
            transport.parse_endpoints(settings.prefill_url),
            engine.runner,
            ident,
            max_inflight_per_worker=settings.max_remote_prefills_per_worker,
            retries=settings.kv_transfer_retries,
            timeout=settings.kv_transfer_timeout_seconds,
            on_transfer=metrics.on_kv_transfer,
            token=backend_auth.load_token(),
        )
        client.start_thread()
        engine.use_remote_prefill(client)
        app.state.prefill_client = client
        metrics.set_role("decode", lambda: sum(w.inflight for w in client.workers()))

        async def close() -> None:
            await asyncio.to_thread(client.close)

        return close
    metrics.set_role(settings.role)

    async def nothing() -> None:
        return None

    return nothing


def create_app(
    settings: config_mod.ServeSettings,
    engine: llm_engine.LLMEngine | None = None,
    verifier: tuple[llm_engine.LLMEngine, tokenizer_mod.Tokenizer | None] | None = None,
) -> FastAPI:
    """``engine`` (and ``verifier``: its engine and, when it differs from the served
    model's, its tokenizer) ready-made, for tests; by default both are loaded here."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal engine, verifier
        if engine is None:
            import hybridllm_models

            try:
                path = await asyncio.to_thread(
                    resolve_model_path,
                    settings.model,
                    settings.verify_model,
                    settings.model_sha256,
                )
            except hybridllm_models.ModelStoreError as exc:
                # Serve nothing, but stay up and say why: /health answers 503 with the
                # reason (a crash loop would hide it behind restarts).
                if settings.exit_on_load_error:
                    termination.exit_for(str(exc), log)
                log.error("refusing to serve: %s", exc)
                app.state.not_ready_reason = str(exc)
                yield
                return
            engine = await asyncio.to_thread(
                llm_engine.LLMEngine.from_path, path, settings.engine_config()
            )
            verifier = await asyncio.to_thread(verifier_mod.load, settings, engine)
        if verifier is not None:
            app.state.verifier = verifier_mod.Verifier(
                async_engine.AsyncEngine(verifier[0]), verifier[1]
            )
            app.state.verifier.engine.start()
        if engine.config.speculative.enabled:
            app.state.metrics.enable_speculative()
        app.state.engine = async_engine.AsyncEngine(engine, app.state.metrics.on_step)
        app.state.metrics.watch_failures(app.state.engine)
        stop = await _start_role(app, settings, engine)
        app.state.engine.start()
        app.state.ready = True
        log.info("serving %s (role %s)", app.state.model_name, settings.role)
        try:
            yield
        finally:
            app.state.ready = False
            await stop()
            app.state.engine.shutdown()
            if app.state.verifier is not None:
                app.state.verifier.engine.shutdown()

    app = FastAPI(title="hybridllm cloud runtime", lifespan=lifespan)
    app.state.settings = settings
    app.state.ready = False
    app.state.not_ready_reason = "model is loading"
    app.state.metrics = server_metrics.ServerMetrics()
    app.state.model_name = served_name(settings)
    app.state.verifier = None

    http_errors.install(app, lambda code: app.state.metrics.rejected.labels(code=code).inc())

    @app.get("/health")
    async def health() -> Response:
        if not app.state.ready:
            return http_errors.error_response(oai.MODEL_NOT_READY, app.state.not_ready_reason)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> oai.ModelList:
        max_len = app.state.engine.engine.info.max_model_len if app.state.ready else None
        return oai.ModelList(data=[oai.ModelCard(id=app.state.model_name, max_model_len=max_len)])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: oai.ChatCompletionRequest, request: Request) -> Response:
        return await serving.Serving(app, APIError).chat(body, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        return await serving.Serving(app, APIError).completion(body, request)

    @app.post("/v1/search", response_model=None)
    async def search(body: search_api.SearchRequest, request: Request) -> Response:
        return await search_api.handle(serving.Serving(app, APIError), body, request)

    return app
