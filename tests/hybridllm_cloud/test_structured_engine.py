"""Constrained decoding inside the cloud engine's continuous batching, on the tiny model:
grammar-bound and free requests share steps, with chunked prefill, the prefix cache,
preemption by recompute and n-gram speculation all at work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.spec_decode.config import SpeculativeConfig
from hybridllm_common import openai_protocol as oai
from hybridllm_common import structured

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "level", "n"],
    "additionalProperties": False,
}


def _constraint(**fields: object) -> structured.Constraint:
    body = oai.CompletionRequest.model_validate({"prompt": "x", **fields})
    c = structured.from_request(body)
    assert c is not None
    return c


def test_constrained_and_free_requests_share_steps_through_preemption_and_speculation(
    tiny_model_dir: Path,
) -> None:
    # 24 blocks of 4 tokens for 8 requests of ~10-token prompts and up to 24-64 new tokens:
    # the cache runs out and requests are preempted and recomputed; 8-token steps chunk
    # every prefill; speculation proposes for the free requests only.
    engine = llm_engine.LLMEngine.from_path(
        tiny_model_dir,
        llm_engine.EngineConfig(
            num_kv_blocks=24,
            block_size=4,
            max_num_batched_tokens=8,
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        ),
    )
    assert engine.tokenizer is not None
    schema = _constraint(response_format={"type": "json_schema",
                         "json_schema": {"name": "s", "schema": SCHEMA}})  # fmt: skip
    regex = _constraint(guided_regex="[a-c]{2,5}-[0-9]{3}")
    texts = ["The quick brown fox jumps", "Hello world! How are", "def add(a, b):", "Edge devices"]
    prompts = [engine.tokenizer.encode(t) for t in texts * 2]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, constraint=schema),
        SamplingParams(max_tokens=64, temperature=0.8, seed=5, constraint=regex),
        SamplingParams(max_tokens=64, temperature=0.0, constraint=regex),
        SamplingParams(max_tokens=64, temperature=1.0, seed=9, constraint=schema),
    ] + [free] * 4
    outs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_spec_drafts > 0
    for out in (outs[0], outs[3]):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in (outs[1], outs[2]):
        assert out.finish_reason == "stop", out.text
        left, _, right = out.text.partition("-")
        assert re.fullmatch("[a-c]{2,5}", left), out.text
        assert re.fullmatch("[0-9]{3}", right), out.text
    # the free requests are what they are alone, in an engine with room and no speculation
    alone = llm_engine.LLMEngine.from_path(
        tiny_model_dir, llm_engine.EngineConfig(num_kv_blocks=256, block_size=4)
    )
    assert [o.token_ids for o in alone.generate(prompts[4:], free)] == [
        o.token_ids for o in outs[4:]
    ]


def test_beam_search_under_a_grammar_is_refused_by_name(tiny_model_dir: Path) -> None:
    params = SamplingParams(
        max_tokens=4, use_beam_search=True, beam_width=2, temperature=0.0,
        constraint=_constraint(guided_choice=["a", "b"]),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^guided_choice: structured output is not supported"):
        params.validate()
