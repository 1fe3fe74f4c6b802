"""The FastAPI app both runtimes serve: state on ``app.state``, one error format, the routes
they share.

A runtime's ``create_app(settings)`` calls :func:`create_app` with its lifespan handler
(which loads the model: ``/health`` answers 503 until it is loaded), its metrics and its
``Serving`` (the chat and text completions on its engine), then adds its own routes.
Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with a stable
code of ``hybridllm_common.openai_protocol`` (``hybridllm_common.http_errors``); request
validation failures are 400s naming the parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridllm_common import http_errors, termination
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import metrics as metrics_mod
from hybridllm_common.serving import settings as settings_mod


class Serving(Protocol):
    """A runtime's completions, made for each request."""

    async def chat(self, body: oai.ChatCompletionRequest, request: Request) -> Response: ...
    async def completion(self, body: oai.CompletionRequest, request: Request) -> Response: ...


def create_app(
    title: str,
    settings: settings_mod.RuntimeSettings,
    metrics: metrics_mod.ServerMetrics,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
    serving: Callable[[FastAPI], Serving],
    max_model_len: Callable[[Any], int],
) -> FastAPI:
    """The app, with ``/health``, ``/metrics``, ``/v1/models``, ``/v1/chat/completions``
    and ``/v1/completions``. ``lifespan`` sets ``app.state.engine`` and
    ``app.state.ready`` (or calls :func:`refuse_to_serve`); ``max_model_len(engine)`` is
    the context length ``/v1/models`` lists."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.state.settings = settings
    app.state.ready = False
    app.state.not_ready_reason = "model is loading"
    app.state.metrics = metrics
    app.state.model_name = settings.served_name()

    http_errors.install(app, lambda code: app.state.metrics.rejected.labels(code=code).inc())

    @app.get("/health")
    async def health() -> Response:
        if not app.state.ready:
            return http_errors.error_response(oai.MODEL_NOT_READY, app.state.not_ready_reason)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> oai.ModelList:
        max_len = max_model_len(app.state.engine) if app.state.ready else None
        return oai.ModelList(data=[oai.ModelCard(id=app.state.model_name, max_model_len=max_len)])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: oai.ChatCompletionRequest, request: Request) -> Response:
        return await serving(app).chat(body, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        return await serving(app).completion(body, request)

    return app


def refuse_to_serve(app: FastAPI, reason: str, log: logging.Logger) -> None:
    """The model cannot be loaded: serve nothing, but stay up and say why (``/health``
    answers 503 with the reason; a crash loop would hide it behind restarts), or, with
    ``--exit-on-load-error``, exit with the reason as the termination message."""
    if app.state.settings.exit_on_load_error:
        termination.exit_for(reason, log)
    log.error("refusing to serve: %s", reason)
    app.state.not_ready_reason = reason
