"""FastAPI app factory of the cloud runtime: the shared app (``hybridllm_common.serving.app``)
with this runtime's engine, roles and ``/v1/search``.

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

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridllm_cloud import config as config_mod
from hybridllm_cloud import model_path
from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.disagg import connector, prefill_server, transport
from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.search import verifier as verifier_mod
from hybridllm_cloud.server import metrics as server_metrics
from hybridllm_cloud.server import search_api, serving
from hybridllm_common import backend_auth
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import app as serving_app

log = logging.getLogger(__name__)


APIError = oai.APIError


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
                    model_path.resolve_model_path,
                    settings.model,
                    settings.verify_model,
                    settings.model_sha256,
                )
            except hybridllm_models.ModelStoreError as exc:
                serving_app.refuse_to_serve(app, str(exc), log)
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

    app = serving_app.create_app(
        "hybridllm cloud runtime",
        settings,
        server_metrics.ServerMetrics(),
        lifespan,
        lambda app: serving.Serving(app, APIError),
        lambda engine: engine.engine.info.max_model_len,
    )
    app.state.verifier = None

    @app.post("/v1/search", response_model=None)
    async def search(body: search_api.SearchRequest, request: Request) -> Response:
        return await search_api.handle(serving.Serving(app, APIError), body, request)

    return app
