"""Hugging Face layout (Llama) -> ONNX with past key/values, and its int8 dynamic quantization.

Graph interface (the names optimum and onnxruntime-genai use for decoder-only models)::

    inputs   input_ids [batch, seq] int64, attention_mask [batch, past + seq] int64,
             position_ids [batch, seq] int64,
             past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim] float32
    outputs  logits [batch, seq, vocab] float32,
             present.{i}.key / .value [batch, kv_heads, past + seq, head_dim] float32

Prefill passes empty pasts (past = 0); each decode step passes the previous presents and
one token, so decoding is incremental, not a re-run of the sequence.

The exported module is our own plain-torch Llama forward (``_Decoder``), loaded from the
folder's safetensors, not transformers' class: transformers' cache objects change between
versions and do not trace into a fixed graph, while a 60-line forward with explicit
key/value tensors does. Its equality with transformers is what the tests check (same
greedy tokens). The exporter is TorchScript (``dynamo=False``): it needs no onnxscript and
gives dynamic batch/sequence/past axes from size arithmetic in the trace. The tied
embedding is duplicated into an explicit ``lm_head`` MatMul weight, so the int8 pass
quantizes the largest matmul.

int8: weight-only block quantization, ``MatMulNBits`` with ``bits=8``: every MatMul whose
second input is a constant (the projections and the lm_head) gets symmetric int8 weights
with one fp32 scale per block of 128 along K; ``accuracy_level=4`` lets onnxruntime compute
it with int8 activations quantized per block at run time. Why not ``quantize_dynamic``
(u8 activations per tensor x s8 weights, ``MatMulInteger``), the recipe before: on x86 CPUs
without VNNI onnxruntime multiplies with ``vpmaddubsw``, whose 16-bit pair sums saturate,
and the model answered nonsense (top-1 agreement 0% with fp32 on an AMD EPYC with AVX2);
onnxruntime's fixes for that (7-bit weights with ``reduce_range``, or u8 weights) still
quantize activations per tensor and lose a lot (perplexity +72%). Weight-only with fp32
compute is the most exact but has no fused 8-bit kernel (0.07x fp32's speed); per-block
int8 compute keeps perplexity within 1.6% of fp32 at 2.3x its decode speed. Blocks of 32
are a little more exact (+0.9%) and 20% slower. Measured side by side with
``bench/models/int8_options.py``. Every artifact is also checked at load on the CPU that
runs it (``hybridllm_models.quality``), so a CPU whose kernels misbehave is caught there.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm_models import errors, manifest
from hybridllm_models.progress import Progress

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
OPSET = 17
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _decoder_class() -> Any:
    import torch

    class _Decoder(torch.nn.Module):
        def __init__(self, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
            super().__init__()
            self.num_layers = config["num_hidden_layers"]
            self.num_heads = config["num_attention_heads"]
            self.num_kv = config.get("num_key_value_heads", self.num_heads)
            self.head_dim = config.get("head_dim") or config["hidden_size"] // self.num_heads
            self.eps = float(config["rms_norm_eps"])
            theta = config.get("rope_theta") or (config.get("rope_parameters") or {})["rope_theta"]
            inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
            params = {
                k.replace(".", "_"): v.float() for k, v in weights.items() if k != "lm_head.weight"
            }
            params["lm_head"] = lm_head.float().clone()
            self.num_params = sum(v.numel() for v in weights.values())
            self.w = torch.nn.ParameterDict(
                {k: torch.nn.Parameter(v, requires_grad=False) for k, v in params.items()}
            )

        def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

        @staticmethod
        def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rotated * sin

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            w = self.w
            batch, seq = input_ids.shape
            x = w["model_embed_tokens_weight"][input_ids]  # [batch, seq, hidden]
            freqs = position_ids.unsqueeze(-1).float() * self.inv_freq  # [batch, seq, head_dim/2]
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [batch, 1, seq, head_dim]
            cos, sin = emb.cos(), emb.sin()
            total = attention_mask.shape[1]
            query_pos = torch.arange(seq, device=x.device) + (total - seq)
            causal = torch.arange(total, device=x.device).unsqueeze(0) <= query_pos.unsqueeze(1)
            allowed = causal.unsqueeze(0).unsqueeze(0) & attention_mask.bool().unsqueeze(
                1
            ).unsqueeze(2)
            bias = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(
                ~allowed, torch.finfo(torch.float32).min
            )  # [batch, 1, seq, total]
            presents = []
            group = self.num_heads // self.num_kv
            for i in range(self.num_layers):
                p = f"model_layers_{i}_"
                h = self._norm(x, w[p + "input_layernorm_weight"])
                q = (h @ w[p + "self_attn_q_proj_weight"].t()).view(
                    batch, seq, self.num_heads, self.head_dim
                )
                k = (h @ w[p + "self_attn_k_proj_weight"].t()).view(
                    batch, seq, self.num_kv, self.head_dim
                )
                v = (h @ w[p + "self_attn_v_proj_weight"].t()).view(
                    batch, seq, self.num_kv, self.head_dim
                )
                q = self._rotate(q.transpose(1, 2), cos, sin)  # [batch, heads, seq, head_dim]
                k = torch.cat((past[2 * i], self._rotate(k.transpose(1, 2), cos, sin)), dim=2)
                v = torch.cat((past[2 * i + 1], v.transpose(1, 2)), dim=2)
                presents += [k, v]
                k = k.repeat_interleave(group, dim=1)  # [batch, heads, total, head_dim]
                v = v.repeat_interleave(group, dim=1)
                scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + bias
                attn = torch.softmax(scores, dim=-1) @ v  # [batch, heads, seq, head_dim]
                attn = attn.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
                x = x + attn @ w[p + "self_attn_o_proj_weight"].t()
                h = self._norm(x, w[p + "post_attention_layernorm_weight"])
                gate = torch.nn.functional.silu(h @ w[p + "mlp_gate_proj_weight"].t())
                x = (
                    x
                    + (gate * (h @ w[p + "mlp_up_proj_weight"].t()))
                    @ w[p + "mlp_down_proj_weight"].t()
                )
            logits = self._norm(x, w["model_norm_weight"]) @ w["lm_head"].t()
            return (logits, *presents)

    return _Decoder


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def load_decoder(hf_dir: Path) -> Any:
    """Our plain-torch decoder with the folder's weights (fp32), as exported."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise errors.ConversionError(
            f"only llama models export to ONNX, not {config.get('model_type')!r}"
        )
    weights = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(shard))
    return _decoder_class()(config, weights).eval(), config


def torch_logits_fn(hf_dir: Path) -> Callable[[list[int]], np.ndarray]:
    """A function from token ids to the decoder's fp32 logits [len(ids), vocab]."""
    import torch

    decoder, _ = load_decoder(hf_dir)

    def run(ids: list[int]) -> np.ndarray:
        empty = torch.zeros(1, decoder.num_kv, 0, decoder.head_dim)
        with torch.no_grad():
            out = decoder(
                torch.tensor([ids], dtype=torch.int64),
                torch.ones(1, len(ids), dtype=torch.int64),
                torch.arange(len(ids)).unsqueeze(0),
                *([empty] * (2 * decoder.num_layers)),
            )
        return np.asarray(out[0][0].numpy(), dtype=np.float32)

    return run


def export(hf_dir: Path, out_dir: Path, progress: Progress) -> int:
    import torch

    decoder, config = load_decoder(hf_dir)
    num_layers, num_kv = config["num_hidden_layers"], decoder.num_kv
    input_names, output_names = io_names(num_layers)
    batch, seq, past_len = 1, 3, 2
    past = [torch.zeros(batch, num_kv, past_len, decoder.head_dim) for _ in range(2 * num_layers)]
    sample = (
        torch.ones(batch, seq, dtype=torch.int64),
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq).unsqueeze(0),
        *past,
    )
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    for name in input_names[3:]:
        axes[name] = {0: "batch", 2: "past_sequence"}
    for name in output_names[1:]:
        axes[name] = {0: "batch", 2: "total_sequence"}
    advance = progress.task("export ONNX", 1)
    with torch.no_grad():
        torch.onnx.export(
            decoder,
            sample,
            str(out_dir / MODEL_FILE),
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )
    advance(1)
    _copy_side_files(hf_dir, out_dir)
    return decoder.num_params


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def quantize_weight_only(
    onnx_dir: Path, out_dir: Path, block_size: int, accuracy_level: int | None
) -> None:
    """int8 weights of every constant MatMul as MatMulNBits (bits=8, symmetric, per block)."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level,
        op_types_to_quantize=("MatMul",),
        bits=8,
    )
    quantizer = nbits.MatMulNBitsQuantizer(
        onnx.load(str(onnx_dir / MODEL_FILE)), algo_config=config
    )
    quantizer.process()
    quantizer.model.save_model_to_file(str(out_dir / MODEL_FILE), False)


# The onnx-int8 recipe (see the module docstring and bench/results/models-int8-options.md).
INT8_BLOCK_SIZE = 128
INT8_ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations, quantized per block


def quantize_int8(onnx_dir: Path, out_dir: Path, progress: Progress) -> int:
    advance = progress.task("quantize ONNX int8", 1)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)  # the quantizer logs one INFO line per tensor on the root logger
    try:
        quantize_weight_only(onnx_dir, out_dir, INT8_BLOCK_SIZE, INT8_ACCURACY_LEVEL)
    finally:
        root.setLevel(level)
    advance(1)
    _copy_side_files(onnx_dir, out_dir)
    return manifest.read(onnx_dir).parameter_count
