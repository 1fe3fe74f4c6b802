"""The Llama-family configuration we need, read from a Hugging Face ``config.json``.

RoPE scaling follows the model's own config: ``default``, ``linear`` and ``llama3``
(the frequency-band rescaling of Llama 3.1+). Both the transformers 4 layout
(``rope_theta`` + ``rope_scaling``) and the transformers 5 one (``rope_parameters``) are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        heads = int(raw["num_attention_heads"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_theta=theta,
            rope_scaling=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> LlamaConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = raw.get("architectures") or ["LlamaForCausalLM"]
        if arch[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
            raise ValueError(f"{path}: architecture {arch[0]} is not a Llama-family decoder")
        return cls.from_dict(raw)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:  # [head_dim // 2] float32
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    kind = config.rope_scaling.get("rope_type", config.rope_scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    factor = float(config.rope_scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(config.rope_scaling.get("low_freq_factor", 1.0))
        high = float(config.rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(config.rope_scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def cos_sin_cache(config: LlamaConfig, max_position: int) -> torch.Tensor:
    """``[max_position, head_dim]`` float32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(config)
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
