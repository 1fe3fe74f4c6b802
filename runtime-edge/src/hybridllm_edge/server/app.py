"""FastAPI app factory of the edge runtime, shaped like the cloud runtime's.

``create_app(settings)`` loads the backend in the lifespan handler (``/health`` answers 503
until it is loaded); tests may pass a ready ``Engine``. Errors leave as
``{"error": {"message", "type", "param", "code"}}`` with the stable codes of
``hybridllm_common.openai_protocol``; request validation failures are 400s naming the
parameter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import hybridllm_models
from hybridllm_common import http_errors, termination
from hybridllm_common import openai_protocol as oai
from hybridllm_edge import backends, cache, config, engine, prompting
from hybridllm_edge.server import metrics as server_metrics
from hybridllm_edge.server import serving
from hybridllm_models import quality

log = logging.getLogger(__name__)


APIError = oai.APIError


def served_name(settings: config.EdgeSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    local = Path(settings.model)
    if local.exists():
        return local.stem if local.is_file() else local.name
    return settings.model.rsplit("#", 1)[-1].split(".", 1)[0] or settings.model


def create_app(settings: config.EdgeSettings, ready_engine: engine.Engine | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = ready_engine
        if eng is None:
            try:
                backend = await asyncio.to_thread(backends.load, settings)
            except (quality.QualityError, hybridllm_models.ModelStoreError) as exc:
                # Serve nothing, but stay up and say why: /health answers 503 with the
                # reason (a crash loop would hide it behind restarts).
                if settings.exit_on_load_error:
                    termination.exit_for(str(exc), log)
                log.error("refusing to serve: %s", exc)
                app.state.not_ready_reason = str(exc)
                yield
                return
            eng = engine.Engine(backend, settings.max_num_batched_tokens)
        eng.on_step = app.state.metrics.on_step
        info = eng.info
        app.state.template = prompting.ChatTemplate(
            info.chat_template, info.bos_token, info.eos_token
        )
        app.state.engine = eng
        eng.start()
        app.state.ready = True
        log.info("serving %s with %s (%d slots)", app.state.model_name, info.name, info.num_slots)
        try:
            yield
        finally:
            app.state.ready = False
            eng.shutdown()

    app = FastAPI(title="hybridllm edge runtime", lifespan=lifespan)
    app.state.settings = settings
    app.state.ready = False
    app.state.not_ready_reason = "model is loading"
    app.state.metrics = server_metrics.ServerMetrics()
    app.state.model_name = served_name(settings)
    app.state.cache = (
        cache.ResponseCache(settings.cache_ttl_seconds, settings.cache_max_entries)
        if settings.cache
        else None
    )

    http_errors.install(app, lambda code: app.state.metrics.rejected.labels(code=code).inc())

    @app.get("/health")
    async def health() -> Response:
        if not app.state.ready:
            return http_errors.error_response(oai.MODEL_NOT_READY, app.state.not_ready_reason)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if app.state.cache is not None:
            app.state.metrics.cache_entries.set(len(app.state.cache))
        return Response(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> oai.ModelList:
        max_len = app.state.engine.info.max_model_len if app.state.ready else None
        return oai.ModelList(data=[oai.ModelCard(id=app.state.model_name, max_model_len=max_len)])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: oai.ChatCompletionRequest, request: Request) -> Response:
        return await serving.Serving(app, APIError).chat(body, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        return await serving.Serving(app, APIError).completion(body, request)

    return app
