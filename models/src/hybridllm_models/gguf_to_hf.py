"""GGUF (llama architecture) -> Hugging Face layout, fp32.

What llama.cpp's ``convert_hf_to_gguf.py`` did, undone:

- Tensor names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` etc.
  A model without ``output.weight`` has tied embeddings (``tie_word_embeddings``).
- Quantized tensors (Q4_1, Q8_0, K-quants) are dequantized with ``gguf.quants`` (numpy) to
  fp32. The dequantized weights are exactly what llama.cpp computes with, so the fp32 model
  reproduces the GGUF's behaviour up to llama.cpp's own arithmetic (it quantizes activations
  to Q8 for Q4_1 matmuls, so greedy tokens agree closely but not always exactly).
- Q and K rows were permuted per head from HF's rotate-half RoPE layout to GGML's
  interleaved pairs: ``w.reshape(h, 2, d/2, n).swapaxes(1, 2)``. The inverse is
  ``w.reshape(h, d/2, 2, n).swapaxes(1, 2)``, with h the query or key/value head count.
- The tokenizer (GPT-2 byte-level BPE: ``tokenizer.ggml.tokens`` and ``merges``; pre-tokenizer
  ``smollm`` = single digits then the GPT-2 regex) is rebuilt with ``tokenizers``; control
  tokens become special added tokens; the chat template goes into ``tokenizer_config.json``.

Weights are written with ``safetensors.numpy``, so this conversion needs no torch.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm_models import errors, manifest
from hybridllm_models.progress import Progress

log = logging.getLogger(__name__)

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match is None or match[2] not in _LAYER_MAP:
        raise errors.ConversionError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_LAYER_MAP[match[2]]}.weight"


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. weight: [num_heads * head_dim, hidden]."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF rotate-half layout -> GGML interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _fields(reader: Any) -> dict[str, Any]:
    values = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        values[key] = field.contents()
    return values


def read_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise errors.ConversionError(
            f"only the llama architecture converts to Hugging Face, not {arch!r}"
        )
    hidden = int(meta["llama.embedding_length"])
    num_heads = int(meta["llama.attention.head_count"])
    num_kv = int(meta.get("llama.attention.head_count_kv", num_heads))
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // num_heads))
    eps = float(f"{float(meta['llama.attention.layer_norm_rms_epsilon']):.6g}")
    theta = float(f"{float(meta.get('llama.rope.freq_base', 10000.0)):.7g}")
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "torch_dtype": "float32",
    }


def build_tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json for a GGUF 'gpt2' (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise errors.ConversionError(
            "only byte-level BPE ('gpt2') GGUF tokenizers convert, "
            f"not {meta.get('tokenizer.ggml.model')!r}"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "gpt2":
        tokenizer.pre_tokenizer = byte_level
    else:
        raise errors.ConversionError(
            f"GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt2 are)"
        )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=kind == TOKEN_TYPE_CONTROL, normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    return tokenizer.to_str(pretty=True)


def tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    decoder = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": kind == TOKEN_TYPE_CONTROL,
        }
        for i, kind in enumerate(token_types)
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    }
    result: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": tokens[config["bos_token_id"]],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": tokens[config["pad_token_id"]],
        "unk_token": tokens[int(unk)] if unk is not None else None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
    }
    if "tokenizer.chat_template" in meta:
        result["chat_template"] = meta["tokenizer.chat_template"]
    return result


def convert(gguf_path: Path, out_dir: Path, progress: Progress) -> int:
    """Write config.json, model.safetensors (fp32), tokenizer files; return the parameter count."""
    import gguf
    from gguf import quants
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path, "r")
    meta = _fields(reader)
    config = read_config(meta)
    num_heads, num_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    advance = progress.task(f"dequantize {gguf_path.name}", len(reader.tensors))
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        weight = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if name.endswith("q_proj.weight"):
            weight = unpermute(weight, num_heads)
        elif name.endswith("k_proj.weight"):
            weight = unpermute(weight, num_kv)
        tensors[name] = np.ascontiguousarray(weight)
        advance(1)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    expected = (
        2
        + config["num_hidden_layers"] * len(_LAYER_MAP)
        + (0 if config["tie_word_embeddings"] else 1)
    )
    if len(tensors) != expected:
        raise errors.ConversionError(
            f"{gguf_path} has {len(tensors)} tensors, a llama model needs {expected}"
        )
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    manifest.dump_json(out_dir / "config.json", config)
    manifest.dump_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    (out_dir / "tokenizer.json").write_text(build_tokenizer_json(meta))
    tok_config = tokenizer_config(meta, config)
    manifest.dump_json(out_dir / "tokenizer_config.json", tok_config)
    manifest.dump_json(
        out_dir / "special_tokens_map.json",
        {
            k: tok_config[k]
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if tok_config[k]
        },
    )
    return sum(int(t.size) for t in tensors.values())


def to_bf16(fp32_dir: Path, out_dir: Path, progress: Progress) -> int:
    """Copy an fp32 Hugging Face folder with its weights cast to bfloat16 (round to nearest)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    for name in fp32_dir.iterdir():
        if name.is_file() and name.suffix != ".safetensors" and name.name != manifest.MANIFEST_NAME:
            shutil.copyfile(name, out_dir / name.name)
    config = json.loads((out_dir / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    manifest.dump_json(out_dir / "config.json", config)
    shards = sorted(fp32_dir.glob("*.safetensors"))
    advance = progress.task("cast to bf16", len(shards))
    num_params = 0
    for shard in shards:
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(shard).items()}
        num_params += sum(t.numel() for t in tensors.values())
        save_file(tensors, str(out_dir / shard.name), metadata={"format": "pt"})
        advance(1)
    return num_params
