"""schemathesis against the cloud runtime's OpenAPI document: no input makes it answer 5xx.

The runtime serves a tiny random-weight model under uvicorn; schemathesis generates
requests from the document FastAPI publishes (valid and invalid bodies, every endpoint)
and each answer must be a success or a 4xx in the OpenAI error shape. Meanwhile a client
streams the same greedy completion again and again: every one of those streams must
complete with the tokens it gives when run alone, whatever the fuzzer sends beside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.server import app as app_mod

from ..conftest import streams_beside
from .test_server import serve


@pytest.fixture(scope="module")
def runtime_url(tiny_model_dir: Path) -> Iterator[str]:
    server_settings = config_mod.ServeSettings(
        model=str(tiny_model_dir), served_model_name="tiny", max_waiting_requests=256
    )
    engine = llm_engine.LLMEngine.from_path(
        tiny_model_dir,
        llm_engine.EngineConfig(num_kv_blocks=512, block_size=4, max_model_len=96),
    )
    with serve(app_mod.create_app(server_settings, engine)) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        yield url


# The document FastAPI publishes: routes and models exist before any model is loaded.
SPEC = app_mod.create_app(config_mod.ServeSettings(model="unused")).openapi()
schema = schemathesis.openapi.from_dict(SPEC)


STEADY = {"model": "tiny", "prompt": "hello there", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def steady_streams(runtime_url: str) -> Iterator[list[str]]:
    """Well-formed streams beside the fuzzer; checked against the answer alone at the end."""
    with streams_beside(runtime_url, {**STEADY, "extra_body": {"ignore_eos": True}}) as texts:
        yield texts


@pytest.mark.usefixtures("steady_streams")
@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_runtime_answer_5xx(case, runtime_url: str) -> None:  # type: ignore[no-untyped-def]
    response = case.call(base_url=runtime_url, timeout=60)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]
