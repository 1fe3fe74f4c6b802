"""``hybridllm model verify``'s quality check: run a stored artifact with the library that serves it.

Each format is run the way its runtime runs it, on this machine's CPU, so the check catches
what hashes cannot (kernels that compute something else here than where the file was
built): GGUF with llama.cpp, ONNX with onnxruntime, safetensors with the plain-torch
decoder. Each library is imported only when an artifact of its format is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from hybridllm_models import errors, quality, store


def gguf_logits_fn(path: Path) -> Callable[[list[int]], np.ndarray]:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=512, n_batch=512, logits_all=True, verbose=False
    )

    def run(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)

    return run


def onnx_logits_fn(folder: Path) -> Callable[[list[int]], np.ndarray]:
    from hybridllm_models.onnx_runner import OnnxCausalLM

    model = OnnxCausalLM(folder)

    def run(ids: list[int]) -> np.ndarray:
        logits, _ = model.forward(ids, model.empty_past())
        return logits

    return run


def logits_fn(artifact: store.Artifact) -> Callable[[list[int]], np.ndarray]:
    fmt = artifact.manifest.format
    try:
        if fmt == "gguf":
            return gguf_logits_fn(artifact.primary_path)
        if fmt == "onnx":
            return onnx_logits_fn(artifact.primary_path)
        from hybridllm_models import onnx_export

        return onnx_export.torch_logits_fn(artifact.primary_path)
    except ImportError as exc:
        raise errors.ConversionError(
            f"checking a {fmt} artifact needs {exc.name}: install hybridllm-models[convert]"
        ) from exc


def check_quality(artifact: store.Artifact) -> quality.Result | None:
    """Run the artifact's quality check; None when it carries no reference (a source)."""
    reference = artifact.manifest.reference
    if reference is None:
        return None
    m = artifact.manifest
    what = f"{m.name}/{m.revision}/{m.artifact} ({m.format} {m.quantization})"
    return quality.check(reference, logits_fn(artifact), what, m.artifact)
