"""FastAPI app factory of the edge runtime: the shared app (``hybridllm_common.serving.app``)
with this runtime's backend, chat template and response cache.

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

from fastapi import FastAPI

import hybridllm_models
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import app as serving_app
from hybridllm_edge import backends, cache, config, engine, prompting
from hybridllm_edge.server import metrics as server_metrics
from hybridllm_edge.server import serving
from hybridllm_models import quality

log = logging.getLogger(__name__)


APIError = oai.APIError


def create_app(settings: config.EdgeSettings, ready_engine: engine.Engine | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = ready_engine
        if eng is None:
            try:
                backend = await asyncio.to_thread(backends.load, settings)
            except (quality.QualityError, hybridllm_models.ModelStoreError) as exc:
                serving_app.refuse_to_serve(app, str(exc), log)
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

    app = serving_app.create_app(
        "hybridllm edge runtime",
        settings,
        server_metrics.ServerMetrics(),
        lifespan,
        lambda app: serving.Serving(app, APIError),
        lambda eng: eng.info.max_model_len,
    )
    app.state.cache = None
    if settings.cache:
        app.state.cache = cache.ResponseCache(
            settings.cache_ttl_seconds, settings.cache_max_entries
        )
        entries = app.state.cache
        app.state.metrics.cache_entries.set_function(lambda: len(entries))  # read at scrape
    return app
