"""The GGUF files the edge benchmarks compare: one model, several weight types.

``q4_1`` is the shipped GGUF; ``q8_0`` and ``f16`` are the model store's conversions of it
(``gguf-q8_0``, ``gguf-f16``); ``q4_0`` is made here from the F16 file with llama.cpp's
quantizer (the store has no such target), kept under the system temp folder for reuse.
Both servers of a comparison always load the same file.
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

STORE_TARGETS = {"q4_1": "gguf", "q8_0": "gguf-q8_0", "f16": "gguf-f16"}
CHOICES = ("q4_1", "q8_0", "q4_0", "f16")


def resolve(weights: str) -> Path:
    import hybridllm_models

    if weights in STORE_TARGETS:
        return Path(hybridllm_models.ensure(target=STORE_TARGETS[weights]))
    if weights != "q4_0":
        raise ValueError(f"unknown weights {weights!r} (choose one of {', '.join(CHOICES)})")
    out = Path(tempfile.gettempdir()) / "hybridllm-edge-bench" / "model-q4_0.gguf"
    if out.exists():
        return out
    import llama_cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 2
    f16 = str(resolve("f16")).encode()
    rc = llama_cpp.llama_model_quantize(f16, str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize(F16 -> Q4_0) failed with {rc}")
    partial.rename(out)
    return out
