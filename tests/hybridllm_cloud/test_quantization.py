"""w8a16: int8 per-channel weights with 16-bit activations, against the bf16 model."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.model import llama
from hybridllm_cloud.sampling_params import SamplingParams

TEXT = (
    "The paged KV cache stores the keys and values of every request in fixed-size blocks, "
    "so that memory is allocated on demand and shared between requests with equal prefixes."
)


def _logits(engine: llm_engine.LLMEngine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of every position, through the engine's own forward pass."""
    engine.add_request("q", ids, SamplingParams(max_tokens=1, temperature=0.0))
    sched = engine.scheduler.schedule()
    runner = engine.runner
    (s,) = sched.scheduled
    bs = runner.block_size
    meta = llama.AttentionMetadata(
        slot_mapping=torch.tensor([s.block_ids[p // bs] * bs + p % bs for p in range(len(ids))]),
        block_tables=torch.tensor([s.block_ids], dtype=torch.int32),
        context_lens=torch.tensor([len(ids)], dtype=torch.int32),
        query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
        decode_only=False,
    )
    hidden = engine.model.forward(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta)
    engine.abort(["q"])
    return engine.model.compute_logits(hidden)


@pytest.mark.slow
def test_w8a16_tracks_bf16(real_model_dir: Path) -> None:
    cfg = llm_engine.EngineConfig(num_kv_blocks=64, max_model_len=512, dtype="bfloat16")
    ref = llm_engine.LLMEngine.from_path(real_model_dir, cfg)
    quant = llm_engine.LLMEngine.from_path(
        real_model_dir, llm_engine.EngineConfig(**{**cfg.__dict__, "quantization": "w8a16"})
    )
    assert isinstance(quant.model.layers[0].qkv, llama.QuantWeight)
    assert quant.model.layers[0].qkv.w_int8.dtype == torch.int8
    assert ref.tokenizer is not None
    ids = ref.tokenizer.encode(TEXT)
    a, b = _logits(ref, ids), _logits(quant, ids)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    top5 = a.topk(5, dim=-1).indices
    within = (top5 == b.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    print(f"top-1 agreement {agree:.3f}, in reference top-5 {within:.3f}, min cosine {cos:.4f}")
    assert agree >= 0.8, agree
    assert within >= 0.97, within
    assert cos > 0.98, cos
    # and it generates through the normal path
    out = quant.generate([ids[:8]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_w8a16_needs_16_bit_activations(tiny_model_dir: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="w8a16 needs"):
        config_mod.ServeSettings(quantization="w8a16", dtype="float32")
    with pytest.raises(ValueError, match="16-bit activations"):
        llama.load_llama(tiny_model_dir, torch.float32, torch.device("cpu"), quantization="w8a16")
    with pytest.raises(ValueError, match="not one of"):
        llama.load_llama(tiny_model_dir, torch.bfloat16, torch.device("cpu"), quantization="int4")
