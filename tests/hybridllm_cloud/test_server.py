"""The server under uvicorn, driven by the real ``openai`` client and by raw HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.server import app as app_mod


@contextlib.contextmanager
def serve(app: object) -> Iterator[str]:
    """Runs the app under uvicorn on a socket bound (and listening) before the thread starts."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[tuple[str, object]]:
    settings = config_mod.ServeSettings(
        model=str(tiny_model_dir), served_model_name="tiny", max_waiting_requests=64
    )
    engine = llm_engine.LLMEngine.from_path(
        tiny_model_dir,
        llm_engine.EngineConfig(num_kv_blocks=256, block_size=4, max_model_len=256),
    )
    app = app_mod.create_app(settings, engine)
    with serve(app) as url:
        # wait for the lifespan: /health answers only once the server accepts
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        yield url, app


@pytest.fixture
def client(server: tuple[str, object]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    assert isinstance(resp.choices[0].message.content, str)


def test_chat_stream_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_and_n(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="tiny",
        prompt="The quick brown",
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 15
    kw = dict(model="tiny", prompt="The quick brown", max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kw)  # type: ignore[call-overload]
    stream = client.completions.create(**kw, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy


def test_invalid_parameter_names_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "temperature"
    assert body["code"] == "invalid_parameter"


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=list(range(10, 300)), max_tokens=2)
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_metrics_exposed(server: tuple[str, object], client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    text = httpx.get(server[0] + "/metrics").text
    for name in (
        "hybridllm_time_to_first_token_seconds_bucket",
        "hybridllm_e2e_request_latency_seconds_count",
        "hybridllm_prompt_tokens_total",
        "hybridllm_num_requests_waiting",
        "hybridllm_kv_cache_blocks_free",
    ):
        assert name in text


def test_disconnect_aborts_and_frees_blocks(server: tuple[str, object]) -> None:
    url, app = server
    engine = app.state.engine  # type: ignore[attr-defined]
    total = engine.engine.info.num_kv_blocks
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    # closed after the first chunk: the request is aborted long before 200 tokens
    assert engine.wait_idle(timeout=30)
    assert engine.engine.stats().num_kv_blocks_free == total
    assert engine.engine.scheduler.requests == {}


def test_overload_is_503_with_retry_after(tiny_model_dir: Path) -> None:
    settings = config_mod.ServeSettings(model=str(tiny_model_dir), max_waiting_requests=1)
    engine = llm_engine.LLMEngine.from_path(
        tiny_model_dir, llm_engine.EngineConfig(num_kv_blocks=64, block_size=4)
    )
    app = app_mod.create_app(settings, engine)
    with serve(app) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        # hold the engine thread's inbox: one pending request fills the bound
        app.state.engine.num_pending = 1
        resp = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "server_overloaded"
        app.state.engine.num_pending = 0


def test_health_is_503_until_loaded(tiny_model_dir: Path) -> None:
    from fastapi.testclient import TestClient

    app = app_mod.create_app(config_mod.ServeSettings(model=str(tiny_model_dir)))
    client = TestClient(app)  # no lifespan: the model is never loaded
    resp = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "model_not_ready"


@pytest.mark.slow
def test_real_model_served_to_openai_client(real_model_dir: Path) -> None:
    settings = config_mod.ServeSettings(
        model=str(real_model_dir), max_model_len=1024, num_kv_blocks=128
    )
    with serve(app_mod.create_app(settings)) as url:
        assert httpx.get(url + "/health", timeout=120).status_code in (200, 503)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        resp = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (resp.choices[0].message.content or "")


def test_a_token_id_outside_the_vocabulary_fails_only_its_own_request(
    server: tuple[str, object], client: openai.OpenAI
) -> None:
    """Once answered 500 'engine step failed' and cut every stream running beside it."""
    _url, app = server
    vocab = app.state.engine.engine.model.config.vocab_size  # type: ignore[attr-defined]
    stream = client.completions.create(
        model="tiny", prompt="hello", max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[1, vocab + 5, 2], max_tokens=2)
    assert caught.value.body["code"] == "invalid_parameter"  # type: ignore[index]
    assert caught.value.body["param"] == "prompt"  # type: ignore[index]
    assert f"token id {vocab + 5} is outside the vocabulary [0, {vocab})" in caught.value.message
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    alone = client.completions.create(
        model="tiny", prompt="hello", max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert text == alone.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"suffix": "x"}, "suffix"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_parameters_nothing_implements_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body=extra,
        )  # fmt: skip
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert param in caught.value.message


def test_no_op_values_sdks_send_by_default_are_accepted(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, tools=[],
    )  # fmt: skip
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(
    server: tuple[str, object],
) -> None:
    url, _ = server
    missing = httpx.get(url + "/v1/nope", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    assert "/v1/nope" in missing.json()["error"]["message"]
    wrong = httpx.get(url + "/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_an_internal_error_answers_a_request_id_not_the_exception_text(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = config_mod.ServeSettings(model=str(tiny_model_dir), served_model_name="tiny")
    engine = llm_engine.LLMEngine.from_path(
        tiny_model_dir, llm_engine.EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=64)
    )
    app = app_mod.create_app(settings, engine)

    @app.get("/explode")
    async def explode() -> None:
        raise RuntimeError("secret path /var/lib/tenant-a/prompt.txt")

    with serve(app) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        resp = httpx.get(url + "/explode", headers={"x-request-id": "req-abc"}, timeout=10)
    assert resp.status_code == 500
    error = resp.json()["error"]
    assert error["code"] == "internal_error"
    assert "req-abc" in error["message"]
    assert "secret" not in resp.text
    assert any("req-abc" in r.getMessage() and r.exc_info for r in caplog.records)
