"""Sampling on the tiny model: seeds, top-k/top-p, logprobs, stop strings and stop ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridllm_cloud import sampler
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> llm_engine.LLMEngine:
    return llm_engine.LLMEngine.from_path(
        tiny_model_dir, llm_engine.EngineConfig(num_kv_blocks=128, block_size=4)
    )


def prompt(engine: llm_engine.LLMEngine, text: str = "The quick brown fox") -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(text)


def test_seed_reproduces_regardless_of_batch(engine: llm_engine.LLMEngine) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    (alone,) = engine.generate([prompt(engine)], p)
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    batched = engine.generate([prompt(engine, "Hello"), prompt(engine)], [other, p])
    assert batched[1].token_ids == alone.token_ids
    (different,) = engine.generate([prompt(engine)], other)
    assert different.token_ids != alone.token_ids


def test_top_k_one_is_greedy(engine: llm_engine.LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    topk1 = SamplingParams(max_tokens=8, temperature=1.3, top_k=1, seed=1, ignore_eos=True)
    a, b = engine.generate([prompt(engine), prompt(engine)], [greedy, topk1])
    assert a.token_ids == b.token_ids


def test_truncation_keeps_only_allowed_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 2.8]])
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        params = SamplingParams(temperature=1.0, top_k=2)
        seen.add(sampler.sample(logits, [params], [gen]).token_ids[0])
    assert seen == {1, 2}
    # top_p small enough keeps only the argmax
    p = SamplingParams(temperature=1.0, top_p=0.05)
    assert {sampler.sample(logits, [p], [gen]).token_ids[0] for _ in range(20)} == {1}


def test_logprobs_are_the_model_distribution(
    engine: llm_engine.LLMEngine, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    ids = prompt(engine)
    p = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, ignore_eos=True)
    (out,) = engine.generate([ids], p)
    (lp,) = out.new_logprobs
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)
    top = torch.topk(ref, 3)
    assert lp.top_token_ids == top.indices.tolist()
    assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.logprob == pytest.approx(float(ref[out.token_ids[0]]), abs=1e-4)


def test_stop_string_truncates_and_finishes(engine: llm_engine.LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (full,) = engine.generate([prompt(engine)], greedy)
    text = full.text
    stop = text[5:7]
    assert stop
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,))
    (out,) = engine.generate([prompt(engine)], p)
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert engine.stats().num_kv_blocks_used == 0


def test_stop_token_id(engine: llm_engine.LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (full,) = engine.generate([prompt(engine)], greedy)
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_id,))
    (out,) = engine.generate([prompt(engine)], p)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_id


def test_streamed_text_concatenates_to_final(engine: llm_engine.LLMEngine) -> None:
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=("zzz",))
    engine.add_request("s1", prompt(engine), p)
    pieces = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final is not None
    assert final.finished
    assert "".join(pieces) == final.text


def test_penalties_follow_openais_definition() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0]])
    params = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=0.5)
    # token 0 was generated twice: presence takes 0.5 once, frequency 0.2 per occurrence
    assert sampler.sample(logits, [params], [None], [[0, 0]]).token_ids == [1]
    out = sampler.apply_penalties(logits[0], [0, 0, 2], presence=0.5, frequency=0.2)
    assert out.tolist() == pytest.approx([3.0 - 0.9, 2.9, 1.0 - 0.7, 0.0])
    negative = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=-1.0)
    assert sampler.sample(logits, [negative], [None], [[2, 2, 2]]).token_ids == [2]
    # no penalty, or nothing generated yet: the raw argmax; logprobs stay the model's own
    plain = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    result = sampler.sample(logits.repeat(2, 1), [plain, params], [None, None], [[0], []])
    assert result.token_ids == [0, 0]
    assert result.logprobs[0] is not None
    assert result.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], 0)[0]))


def test_a_frequency_penalty_stops_a_greedy_loop(engine: llm_engine.LLMEngine) -> None:
    prompt = [5, 6, 7, 8, 9]
    base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = engine.generate([prompt], base)[0].token_ids
    penalized = engine.generate(
        [prompt],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0),
    )[0].token_ids
    assert penalized != plain
    assert max(penalized.count(t) for t in set(penalized)) <= max(
        plain.count(t) for t in set(plain)
    )
