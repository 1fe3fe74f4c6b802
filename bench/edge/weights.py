"""The GGUF files the edge benchmarks compare: one model, several weight types.

``q4_1`` is the shipped GGUF; the others are the model store's conversions of it
(``gguf-q8_0``, ``gguf-q4_k_m``, ``gguf-q4_0``, ``gguf-f16``: llama.cpp's quantizer applied
to the F16 file). Both servers of a comparison always load the same file.
"""

from __future__ import annotations

from pathlib import Path

STORE_TARGETS = {
    "q4_1": "gguf",
    "q8_0": "gguf-q8_0",
    "q4_k_m": "gguf-q4_k_m",
    "q4_0": "gguf-q4_0",
    "f16": "gguf-f16",
}
CHOICES = tuple(STORE_TARGETS)


def resolve(weights: str) -> Path:
    import hybridllm_models

    if weights not in STORE_TARGETS:
        raise ValueError(f"unknown weights {weights!r} (choose one of {', '.join(CHOICES)})")
    return Path(hybridllm_models.ensure(target=STORE_TARGETS[weights]))
