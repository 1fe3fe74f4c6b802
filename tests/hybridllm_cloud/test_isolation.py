"""A failed engine step fails only the request that caused it (AsyncEngine isolation).

The fault is real: a prompt with a token id outside the vocabulary, given to the engine
directly (the servers refuse it at admission), makes the embedding lookup raise inside a
batched step with the other requests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.engine.request import Priority
from hybridllm_cloud.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, 36, 37, 38]]


def _engine(model_dir: Path) -> llm_engine.LLMEngine:
    config = llm_engine.EngineConfig(num_kv_blocks=64, block_size=4, max_model_len=128)
    return llm_engine.LLMEngine.from_path(model_dir, config)


async def _run(
    engine: async_engine.AsyncEngine, prompts: list[list[int]], params: SamplingParams
) -> list[list[int] | BaseException]:
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
    for tag, prompt in enumerate(prompts):
        engine.add(f"r{tag}", prompt, params, Priority.INTERACTIVE, queue, tag=tag)  # type: ignore[arg-type]
    results: dict[int, list[int] | BaseException] = {}
    while len(results) < len(prompts):
        tag, item = await asyncio.wait_for(queue.get(), timeout=120)
        if isinstance(item, BaseException):
            results[tag] = item
        elif item.finished:  # type: ignore[attr-defined]
            results[tag] = list(item.token_ids)  # type: ignore[attr-defined]
    return [results[i] for i in range(len(prompts))]


def test_a_failing_request_fails_alone_and_the_others_finish_as_if_alone(
    tiny_model_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [out.token_ids for out in _engine(tiny_model_dir).generate(PROMPTS, params)]

    engine = _engine(tiny_model_dir)
    vocab = engine.model.config.vocab_size
    runner = async_engine.AsyncEngine(engine)
    runner.start()
    try:
        bad = [1, 2, vocab + 5, 3]
        results = asyncio.run(_run(runner, [PROMPTS[0], bad, PROMPTS[1], PROMPTS[2]], params))
        assert runner.wait_idle(timeout=60)
    finally:
        runner.shutdown()
    failed = results[1]
    assert isinstance(failed, async_engine.RequestFailed)
    assert "the engine failed this request (IndexError)" in str(failed)
    assert [results[0], results[2], results[3]] == alone
    assert runner.num_step_failures >= 1
    assert runner.num_requests_failed == 1
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked by the holds


def test_the_engine_keeps_serving_after_isolating(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = _engine(tiny_model_dir)
    vocab = engine.model.config.vocab_size
    runner = async_engine.AsyncEngine(engine)
    runner.start()
    try:
        first = asyncio.run(_run(runner, [[vocab + 1, 4], PROMPTS[0]], params))
        second = asyncio.run(_run(runner, [PROMPTS[1], PROMPTS[2]], params))
    finally:
        runner.shutdown()
    assert isinstance(first[0], async_engine.RequestFailed)
    assert isinstance(first[1], list)
    assert len(first[1]) == 6
    assert all(isinstance(r, list) and len(r) == 6 for r in second)
    assert not runner._isolating
