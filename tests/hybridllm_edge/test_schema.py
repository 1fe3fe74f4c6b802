"""schemathesis against the edge runtime's OpenAPI document: no input makes it answer 5xx.

The real model on llama.cpp, with a short context so that every generated request ends
quickly; schemathesis sends valid and invalid bodies to every endpoint, and each answer
must be a success or a 4xx in the OpenAI error shape. Meanwhile a client streams the same
greedy completion again and again: every one of those streams must complete with the
text it gives when run alone, whatever the fuzzer sends beside it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from hybridllm_edge import config
from hybridllm_edge.server import app as app_mod

from ..conftest import streams_beside
from .conftest import serve

SPEC = app_mod.create_app(config.EdgeSettings()).openapi()
schema = schemathesis.openapi.from_dict(SPEC)


@pytest.fixture(scope="module")
def edge_url() -> Iterator[str]:
    settings_ = config.EdgeSettings(
        served_model_name="smollm2",
        backend="llamacpp",
        parallel=4,
        max_model_len=64,
        threads=1,
        max_waiting_requests=256,
    )
    for running in serve(settings_):
        yield running.base_url


@pytest.fixture(scope="module")
def steady_streams(edge_url: str) -> Iterator[list[str]]:
    """Well-formed streams beside the fuzzer; checked against the answer alone at the end."""
    request = {"model": "smollm2", "prompt": "hello there", "max_tokens": 16, "temperature": 0}
    with streams_beside(edge_url, request) as texts:
        yield texts


@pytest.mark.usefixtures("steady_streams")
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_edge_runtime_answer_5xx(case, edge_url: str) -> None:  # type: ignore[no-untyped-def]
    response = case.call(base_url=edge_url, timeout=60)
    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:300]
