"""Hugging Face layout (Llama) -> GGUF f16 with the ``gguf`` library, then llama.cpp's quantizer.

The f16 file is written by us: the config becomes ``llama.*`` keys, the tokenizer.json
vocabulary, merges and added tokens become ``tokenizer.ggml.*`` (special added tokens are
CONTROL, other added tokens USER_DEFINED), the chat template is copied, Q and K rows are
permuted to GGML's interleaved RoPE layout (the inverse of what ``gguf_to_hf`` undoes),
1-D tensors stay f32 and matrices become f16, as llama.cpp's own converter does.

Q8_0, Q4_K_M and Q4_0 come from that f16 file through llama.cpp's ``llama_model_quantize`` (the
low-level binding of llama-cpp-python), so the quantized bytes are exactly llama.cpp's.
K-quants need rows that are multiples of 256; SmolLM2's hidden size 576 is not, so
llama.cpp falls back to other types for those tensors (it logs which) — that is its
standard behaviour for this model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm_models import errors, fileinfo, gguf_to_hf
from hybridllm_models.progress import Progress

log = logging.getLogger(__name__)

_TO_GGUF = {f"{v}.weight": k for k, v in gguf_to_hf._LAYER_MAP.items()}
_GLOBAL = {v: k for k, v in gguf_to_hf._GLOBAL_MAP.items()}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in _TO_GGUF:
        return f"blk.{parts[2]}.{_TO_GGUF[parts[3]]}.weight"
    raise errors.ConversionError(f"no GGUF name for tensor {hf!r}")


def _pre_tokenizer_name(pre: dict[str, Any] | None) -> str:
    if pre is None:
        raise errors.ConversionError(
            "tokenizer.json has no pre-tokenizer; only byte-level BPE converts"
        )
    kinds = [p["type"] for p in pre.get("pretokenizers", [pre])]
    if kinds == ["ByteLevel"]:
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and pre["pretokenizers"][0].get("individual_digits"):
        return "smollm"
    raise errors.ConversionError(f"pre-tokenizer {kinds} has no llama.cpp equivalent known here")


def _add_tokenizer(writer: Any, hf_dir: Path, config: dict[str, Any]) -> None:
    import gguf

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise errors.ConversionError(f"only BPE tokenizers convert, not {model.get('type')!r}")
    vocab: dict[str, int] = dict(model["vocab"])
    kinds: dict[int, int] = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = (
            gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        )
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, index in vocab.items():
        tokens[index] = text
        types[index] = kinds.get(index, gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tok.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}

    def token_id(key: str) -> int | None:
        value = tok_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if isinstance(value, str) else None

    bos = config.get("bos_token_id", token_id("bos_token"))
    eos = config.get("eos_token_id", token_id("eos_token"))
    if isinstance(eos, list):
        eos = eos[0]
    for setter, value in (
        (writer.add_bos_token_id, bos),
        (writer.add_eos_token_id, eos),
        (writer.add_unk_token_id, token_id("unk_token")),
        (writer.add_pad_token_id, config.get("pad_token_id", token_id("pad_token"))),
    ):
        if value is not None:
            setter(int(value))
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_add_space_prefix(False)
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def convert(hf_dir: Path, out_path: Path, progress: Progress) -> int:
    """Write an f16 GGUF of a Llama Hugging Face folder; return the parameter count."""
    import gguf
    from safetensors import safe_open

    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise errors.ConversionError(
            f"only llama models convert to GGUF, not {config.get('model_type')!r}"
        )
    num_heads = config["num_attention_heads"]
    num_kv = config.get("num_key_value_heads", num_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0
    )
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_type("model")
    writer.add_name(hf_dir.parent.parent.name if hf_dir.name == "hf" else hf_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config["hidden_size"] // num_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_tokenizer(writer, hf_dir, config)
    shards = sorted(hf_dir.glob("*.safetensors"))
    advance = progress.task("write f16 GGUF", None)
    num_params = 0
    for shard in shards:
        with safe_open(shard, "np") as f:  # bf16 shards need "pt"; fp32/fp16 read as numpy
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                weight = f.get_tensor(name).astype(np.float32)
                if name.endswith("q_proj.weight"):
                    weight = gguf_to_hf.permute(weight, num_heads)
                elif name.endswith("k_proj.weight"):
                    weight = gguf_to_hf.permute(weight, num_kv)
                num_params += weight.size
                data = weight if weight.ndim == 1 else weight.astype(np.float16)
                writer.add_tensor(gguf_name(name), np.ascontiguousarray(data))
                advance(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return num_params


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send file descriptor 2 to a file: llama.cpp prints one line per tensor from C."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def quantize(f16_path: Path, out_path: Path, ftype: str, progress: Progress) -> int:
    """Quantize an f16 GGUF with llama.cpp (``Q8_0``, ``Q4_K_M`` or ``Q4_0``); return the parameter count."""
    import ctypes

    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise errors.ConversionError(f"llama.cpp has no file type {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = max(1, min(4, os.cpu_count() or 1))
    advance = progress.task(f"quantize {ftype}", 1)
    log_path = out_path.parent / ".quantize.log"
    with _stderr_to(log_path):
        status = llama_cpp.llama_model_quantize(
            str(f16_path).encode(), str(out_path).encode(), ctypes.byref(params)
        )
    report = log_path.read_text(errors="replace")
    log_path.unlink()
    fallbacks = report.count("falling back to")
    if fallbacks:
        log.info(
            "llama.cpp used fallback types for %d tensors (rows not a multiple of 256)", fallbacks
        )
    if status != 0:
        raise errors.ConversionError(
            f"llama_model_quantize({f16_path} -> {ftype}) failed with {status}: {report[-2000:]}"
        )
    advance(1)
    num_params, file_type = fileinfo.gguf_summary(out_path)
    if file_type != ftype:
        raise errors.ConversionError(f"{out_path} came out as {file_type}, not {ftype}")
    return num_params
