"""Llama-family decoder over a paged KV cache: RMSNorm, RoPE, GQA, SwiGLU.

Every op goes through ``hybridllm_kernels.ops`` (Triton on CUDA, torch references
elsewhere); only the matmuls and the embedding are plain torch. The forward pass takes
all scheduled tokens of a step packed into one sequence (``[num_tokens, ...]``) plus the
attention metadata built by ``kv_cache.pack``; for every layer the K/V of all tokens are
written to the cache before any attention reads it, which is what lets requests in the
same step share prefix blocks.

Weights are fused at load time (q|k|v into ``qkv``, gate|up into ``gate_up``) so a layer
runs four matmuls, and stored transposed (``[in, out]``, contiguous): ``x @ w`` on that
layout is about 2x faster than ``F.linear`` on ``[out, in]`` for decode-sized batches on
CPU (MKL, measured in bench/cloud) and no slower on GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from hybridllm_cloud.model import config as model_config
from hybridllm_kernels import ops


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    decode_only: bool  # every sequence has exactly one query token


@dataclass
class QuantWeight:
    """w8a16: int8 weight ``[out_features, in_features]`` with one scale per output channel."""

    w_int8: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_transposed(cls, w_t: torch.Tensor) -> QuantWeight:
        w_int8, scales = ops.quantize_per_channel_int8(w_t.t())
        return cls(w_int8.contiguous(), scales.to(w_t.device))


Weight = torch.Tensor | QuantWeight


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        return ops.w8a16_matmul(x, w.w_int8, w.scales)
    return x @ w


@dataclass
class LayerWeights:
    """Linear weights transposed: ``[in_features, out_features]`` (or int8, see QuantWeight)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim]
    o: Weight  # [num_heads * head_dim, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [hidden, 2 * intermediate]
    down: Weight  # [intermediate, hidden]

    def quantize_w8a16(self) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(self, name)
            if isinstance(w, torch.Tensor):
                setattr(self, name, QuantWeight.from_transposed(w))

    @classmethod
    def from_hf(
        cls,
        input_norm: torch.Tensor,
        qkv: torch.Tensor,
        o: torch.Tensor,
        post_norm: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
    ) -> LayerWeights:
        """From Hugging Face ``[out, in]`` linear weights."""

        def t(w: torch.Tensor) -> torch.Tensor:
            return w.t().contiguous()

        return cls(input_norm, t(qkv), t(o), post_norm, t(gate_up), t(down))


class LlamaModel:
    def __init__(
        self,
        config: model_config.LlamaConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_position: int,
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.norm = norm
        self.lm_head_t = lm_head.t().contiguous()  # [hidden, vocab]
        self.cos_sin_cache = model_config.cos_sin_cache(config, max_position).to(embed.device)
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``layer_hook(i)`` runs once layer ``i`` has written this step's K/V to the cache
        (the prefill role ships them from there while the next layers compute)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if residual is None:
                residual = x
                x = ops.rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.fused_add_rms_norm(
                    x, residual, layer.input_norm, cfg.rms_norm_eps
                )
            qkv = linear(x, layer.qkv)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_attention_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            q, k = ops.rotary_embedding(positions, q, k, self.cos_sin_cache, True)
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            if layer_hook is not None:
                layer_hook(i)
            if meta.decode_only:
                attn = ops.paged_decode_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale
                )
            else:
                attn = ops.paged_prefill_attention(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.query_start_loc,
                    meta.context_lens,
                    self.scale,
                )
            x = linear(attn.reshape(num_tokens, self.q_size), layer.o)
            x, residual = ops.fused_add_rms_norm(x, residual, layer.post_norm, cfg.rms_norm_eps)
            x = linear(ops.silu_and_mul(linear(x, layer.gate_up)), layer.down)
        assert residual is not None
        x, _ = ops.fused_add_rms_norm(x, residual, self.norm, cfg.rms_norm_eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return (hidden @ self.lm_head_t).float()


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    return files


def load_llama(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int | None = None,
    quantization: str = "none",
) -> LlamaModel:
    """Loads a Hugging Face layout folder (config.json + safetensors).

    ``quantization="w8a16"``: the layers' linear weights become int8 with per-channel scales
    (activations stay in ``dtype``, which must then be 16-bit); embedding and LM head stay.
    """
    if quantization not in ("none", "w8a16"):
        raise ValueError(f"quantization: {quantization!r} is not one of none, w8a16")
    if quantization == "w8a16" and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("quantization: w8a16 needs 16-bit activations (dtype bfloat16 or float16)")
    cfg = model_config.LlamaConfig.from_dir(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name.removeprefix("model.")] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise KeyError(f"{path}: weight {name!r} missing")
        return tensors[name].to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        layers.append(
            LayerWeights.from_hf(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                o=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
        if quantization == "w8a16":
            layers[-1].quantize_w8a16()
    embed = take("embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in tensors else None
    if lm_head is None:
        lm_head = tensors["lm_head.weight"].to(device=device, dtype=dtype)
    return LlamaModel(
        cfg,
        embed,
        layers,
        take("norm.weight"),
        lm_head,
        max_position or cfg.max_position_embeddings,
    )
