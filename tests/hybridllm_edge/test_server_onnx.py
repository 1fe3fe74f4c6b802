"""The edge server on onnxruntime (the store's export with past key/values), fp32 and int8."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import httpx
import openai
import pytest

from hybridllm_edge import backends, config, engine, sampling
from hybridllm_models import onnx_runner, quality

BYPASS = {"x-hybridllm-cache": "bypass"}
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Who wrote Hamlet?"]


def _ask(client, question: str) -> tuple[str, int]:
    resp = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": question}],
        max_tokens=10,
        temperature=0,
        extra_headers=BYPASS,
    )
    return resp.choices[0].message.content or "", resp.usage.completion_tokens


def test_onnx_answers_the_reference_greedy_tokens(onnx_server) -> None:
    """Our incremental serving loop gives the tokens of the store's plain reference decoder."""
    client = onnx_server.client()
    eng = onnx_server.app.state.engine
    prompt = eng.backend.encode(
        onnx_server.app.state.template.render([{"role": "user", "content": QUESTIONS[0]}]),
        add_special=False,
    )
    reference = onnx_runner.OnnxCausalLM(Path(eng.info.model_path)).greedy(prompt, 10, eos_id=2)
    resp = client.completions.create(
        model="", prompt=prompt, max_tokens=10, temperature=0, logprobs=0
    )
    tokens = resp.choices[0].logprobs.tokens
    expected = [eng.backend.token_bytes(t).decode("utf-8", "replace") for t in reference]
    if reference[-1] in eng.info.eos_token_ids:
        expected = expected[:-1]
        tokens = tokens[: len(expected)]
    assert tokens == expected
    stream = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_headers=BYPASS,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream) == _ask(client, QUESTIONS[0])[0]
    )


def test_onnx_concurrent_requests_give_the_sequential_answers(onnx_server) -> None:
    client = onnx_server.client()
    sequential = [_ask(client, q) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        assert list(pool.map(lambda q: _ask(client, q), QUESTIONS)) == sequential


def test_onnx_int8_backend_decodes() -> None:
    settings = config.EdgeSettings(backend="onnx", quantization="int8", parallel=2, threads=1)
    backend = backends.load(settings)
    assert backend.info.revision.split("/")[1] == "onnx-int8"
    eng = engine.Engine(backend, 256)
    outputs: list[engine.Output] = []
    done = threading.Event()

    def emit(out: engine.Output | BaseException) -> None:
        assert isinstance(out, engine.Output)
        outputs.append(out)
        if out.finished:
            done.set()

    prompt = backend.encode("The capital of France is", add_special=True)
    eng.start()
    try:
        eng.add(
            engine.EngineRequest(
                "r", prompt, sampling.SamplingParams(max_tokens=6, temperature=0), emit
            )
        )
        assert done.wait(timeout=120)
        assert eng.wait_idle(timeout=60)
        # finished: the slot keeps the KV of what it computed (the prompt cache), all the
        # prompt and every sampled token but the last, which was never fed back
        assert backend.slot_length(0) == eng.cached_length(0) == len(prompt) + len(outputs) - 1
    finally:
        eng.shutdown()
    assert outputs[-1].num_output_tokens == len(outputs) <= 6
    assert outputs[-1].text.strip()


def test_a_variant_that_fails_its_quality_check_is_not_served(broken_int8_dir: Path) -> None:
    settings = config.EdgeSettings(
        model=str(broken_int8_dir), backend="onnx", quantization="int8", threads=1, parallel=1
    )
    with pytest.raises(quality.QualityError, match="failed its quality check: KL divergence"):
        backends.load(settings)


def test_the_server_stays_up_and_says_why_it_refuses_to_serve(broken_onnx_server) -> None:
    health = httpx.get(f"{broken_onnx_server.base_url}/health", timeout=30)
    assert health.status_code == 503
    error = health.json()["error"]
    assert error["code"] == "model_not_ready"
    assert "failed its quality check: KL divergence" in error["message"]
    assert "x the limit of 0.03" in error["message"]
    with pytest.raises(openai.APIStatusError) as caught:
        broken_onnx_server.client().chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.status_code == 503
    assert "failed its quality check" in caught.value.message
