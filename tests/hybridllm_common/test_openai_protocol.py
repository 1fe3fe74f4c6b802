"""The shared OpenAI models: validation names the parameter, errors have the stable shape."""

from __future__ import annotations

import pydantic
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from hybridllm_common import http_errors, metrics, openai_protocol


def test_chat_request_accepts_openai_client_payload() -> None:
    req = openai_protocol.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "unknown_field": 1,
        }
    )
    assert req.messages[0].text() == "hi"
    assert req.include_usage_in_stream()
    assert req.stop_list() == []


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_invalid_parameters_name_the_parameter(payload: dict[str, object], param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **payload}
    with pytest.raises(pydantic.ValidationError) as info:
        openai_protocol.ChatCompletionRequest.model_validate(body)
    loc = info.value.errors()[0]["loc"]
    assert openai_protocol.validation_error_param(("body", *loc)) == param


def test_top_logprobs_requires_logprobs() -> None:
    with pytest.raises(pydantic.ValidationError, match="top_logprobs requires logprobs"):
        openai_protocol.ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
        )


def test_completion_prompt_forms() -> None:
    assert openai_protocol.CompletionRequest(prompt="a").prompt == "a"
    assert openai_protocol.CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    with pytest.raises(pydantic.ValidationError):
        openai_protocol.CompletionRequest(prompt="")


def test_the_generation_cap_counts_every_candidate_and_a_missing_max_tokens() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    chat = openai_protocol.ChatCompletionRequest
    assert chat(messages=msgs, max_tokens=100).generation_cap(4096) == 100
    assert chat(messages=msgs, max_completion_tokens=50, n=2).generation_cap(4096) == 100
    assert chat(messages=msgs).generation_cap(4096) == 4096  # to the end of the context
    best = openai_protocol.CompletionRequest(prompt="x", max_tokens=10, n=2, best_of=5)
    assert best.generation_cap(4096) == 50


def test_make_error_shape_and_status() -> None:
    status, body = openai_protocol.make_error(
        openai_protocol.CONTEXT_LENGTH_EXCEEDED, "too long", param="messages"
    )
    assert status == 400
    assert body.model_dump() == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert openai_protocol.make_error(openai_protocol.SERVER_OVERLOADED, "busy")[0] == 503


def test_stream_chunk_serialises_without_nulls() -> None:
    chunk = openai_protocol.ChatCompletionChunk(
        id="c1",
        model="m",
        choices=[
            openai_protocol.ChatChunkChoice(index=0, delta=openai_protocol.ChatDelta(content="x"))
        ],
    )
    data = chunk.model_dump(exclude_none=True)
    assert data["object"] == "chat.completion.chunk"
    assert data["choices"][0]["delta"] == {"content": "x"}


def test_metric_names_are_prefixed() -> None:
    names = [v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)]
    assert names
    assert all(n.startswith(metrics.PREFIX) for n in names)


def test_a_runtime_refuses_a_body_past_its_limit_announced_or_streamed() -> None:
    """The runtimes' shared error layer bounds the body: a Content-Length over the cap is
    refused before a byte is read, and a chunked body as its count passes the cap."""
    app = FastAPI()
    http_errors.install(app, lambda code: None, max_body_bytes=1000)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"n": len(await request.body())}

    client = TestClient(app)
    assert client.post("/echo", content=b"x" * 1000).json() == {"n": 1000}
    for body in (b"x" * 1001, iter([b"x" * 600, b"x" * 600])):  # announced; chunked
        r = client.post("/echo", content=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request"
        assert "over 1000 bytes" in r.json()["error"]["message"]
