"""A test double of the model: a Llama of any shape with random weights, built in memory.

For tests that need a model of a given configuration (vocabulary, layers) but not its
outputs: the engine's checks of a draft model against its target, the KV budget. A model
whose tokens matter is the tiny one saved by ``conftest.py`` (loaded through the real path)
or the real one.
"""

from __future__ import annotations

import torch

from hybridllm_cloud.model import config as model_config
from hybridllm_cloud.model import llama


def random_llama(
    cfg: model_config.LlamaConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    seed: int = 0,
) -> llama.LlamaModel:
    """Random weights of the given shape (embedding tied to the LM head, unit norms)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02
        return t.to(device=device, dtype=dtype)

    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    ones = torch.ones(h, device=device, dtype=dtype)
    layers = [
        llama.LayerWeights.from_hf(
            ones,
            w(qkv_out, h),
            w(h, cfg.num_attention_heads * cfg.head_dim),
            ones,
            w(2 * i, h),
            w(h, i),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    embed = w(cfg.vocab_size, h)
    return llama.LlamaModel(cfg, embed, layers, ones, embed, max_position)
