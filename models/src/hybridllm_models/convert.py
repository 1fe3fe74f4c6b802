"""Conversion targets, their recipes, and ``ensure``: pull and convert on demand, cached.

Targets form a small tree rooted at the pulled source::

    source (GGUF Q4_1, or an HF folder)
      -> hf (fp32 safetensors)          -> hf-bf16
                                        -> gguf-f16 -> gguf-q8_0, gguf-q4_k_m, gguf-q4_0
                                        -> onnx (fp32, past key/values) -> onnx-int8
    gguf = the source GGUF as shipped (gguf-f16 when the source is an HF folder)

Each target is built once per (source sha256, target, recipe version): its manifest records
the source's sha256 and the recipe (``RECIPE_VERSIONS``), and ``Store.build_artifact``
reuses it while both match, so a second ``ensure`` or ``hybridllm model convert`` returns at
once, and a store built by an older recipe is rebuilt. Every conversion also stores the
fp32 model's reference outputs on fixed prompts (``hybridllm_models.quality``), which
runtimes and ``verify`` compare their own outputs against. Conversion modules import torch, transformers,
onnx and llama_cpp lazily; the store does not need them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from hybridllm_models import errors, quality, store, uri
from hybridllm_models.progress import NULL, Progress
from hybridllm_models.store import Artifact, Built

log = logging.getLogger(__name__)

TARGETS = (
    "hf",
    "hf-bf16",
    "gguf",
    "gguf-f16",
    "gguf-q8_0",
    "gguf-q4_k_m",
    "gguf-q4_0",
    "onnx",
    "onnx-int8",
)

Recipe = Callable[[Path, Path, Progress], Built]


def _gguf_to_hf(parent: Path, out: Path, progress: Progress) -> Built:
    from hybridllm_models import gguf_to_hf

    num_params = gguf_to_hf.convert(parent, out, progress)
    return Built("safetensors", "f32", num_params, ".")


def _hf_to_bf16(parent: Path, out: Path, progress: Progress) -> Built:
    from hybridllm_models import gguf_to_hf

    num_params = gguf_to_hf.to_bf16(parent, out, progress)
    return Built("safetensors", "bf16", num_params, ".")


def _hf_to_gguf_f16(parent: Path, out: Path, progress: Progress) -> Built:
    from hybridllm_models import hf_to_gguf

    num_params = hf_to_gguf.convert(parent, out / "model-f16.gguf", progress)
    return Built("gguf", "F16", num_params, "model-f16.gguf")


def _quantize(ftype: str) -> Recipe:
    def recipe(parent: Path, out: Path, progress: Progress) -> Built:
        from hybridllm_models import hf_to_gguf

        name = f"model-{ftype.lower()}.gguf"
        num_params = hf_to_gguf.quantize(parent, out / name, ftype, progress)
        return Built("gguf", ftype, num_params, name)

    return recipe


def _hf_to_onnx(parent: Path, out: Path, progress: Progress) -> Built:
    from hybridllm_models import onnx_export

    num_params = onnx_export.export(parent, out, progress)
    return Built("onnx", "f32", num_params, ".")


def _onnx_to_int8(parent: Path, out: Path, progress: Progress) -> Built:
    from hybridllm_models import onnx_export

    num_params = onnx_export.quantize_int8(parent, out, progress)
    return Built("onnx", "int8", num_params, ".")


# Bump a target's version when its recipe changes what it writes: stores rebuild it.
# onnx-int8/4: weight-only int8 (MatMulNBits, blocks of 128, int8 compute) instead of
# dynamic u8 x s8, which saturates on x86 CPUs without VNNI (see onnx_export.quantize_int8).
RECIPE_VERSIONS: dict[str, int] = {
    "hf": 2,
    "hf-bf16": 2,
    "gguf-f16": 2,
    "gguf-q8_0": 2,
    "gguf-q4_k_m": 2,
    "gguf-q4_0": 2,
    "onnx": 2,
    "onnx-int8": 4,
}


def recipe_id(target: str) -> str:
    return f"{target}/{RECIPE_VERSIONS[target]}"


def fp32_reference(hf_dir: Path, quantization: str, progress: Progress) -> quality.Reference:
    """The fp32 model's outputs on the quality prompts, with the tolerance of a variant."""
    import tokenizers

    from hybridllm_models import onnx_export

    advance = progress.task("fp32 reference outputs", len(quality.PROMPTS))
    tokenizer = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in quality.PROMPTS]
    run = onnx_export.torch_logits_fn(hf_dir)
    logits = []
    for ids in prompts:
        logits.append(run(ids))
        advance(1)
    return quality.make_reference(
        prompts, logits, quantization, computed_with="hybridllm plain-torch decoder, fp32"
    )


# target -> (parent target, recipe taking the parent's primary path)
RECIPES: dict[str, tuple[str, Recipe]] = {
    "hf": (store.SOURCE, _gguf_to_hf),
    "hf-bf16": ("hf", _hf_to_bf16),
    "gguf-f16": ("hf", _hf_to_gguf_f16),
    "gguf-q8_0": ("gguf-f16", _quantize("Q8_0")),
    "gguf-q4_k_m": ("gguf-f16", _quantize("Q4_K_M")),
    "gguf-q4_0": ("gguf-f16", _quantize("Q4_0")),
    "onnx": ("hf", _hf_to_onnx),
    "onnx-int8": ("onnx", _onnx_to_int8),
}


def ensure_artifact(
    source_uri: str = uri.DEFAULT_URI,
    target: str = "hf",
    *,
    model_store: store.Store | None = None,
    force: bool = False,
    verify: bool = False,
    expected_sha256: str | None = None,
    progress: Progress = NULL,
) -> Artifact:
    """The artifact for (source, target), pulled and converted as needed.

    ``force`` rebuilds the target itself (not its parents). ``verify`` re-hashes every
    file of the artifact against its manifest (what a runtime does before loading) and
    raises :class:`errors.IntegrityError` naming each bad file and the command that
    rebuilds it: a flipped byte keeps the size that the cheap presence check looks at.
    ``expected_sha256`` refuses a source whose content hash differs (IntegrityError).
    """
    if target not in (*TARGETS, store.SOURCE):
        raise errors.ConversionError(
            f"unknown target {target!r}; known targets: {', '.join(TARGETS)}"
        )
    model_store = model_store or store.Store()
    source = model_store.pull(source_uri, expected_sha256=expected_sha256, progress=progress)
    artifact = _ensure(model_store, source, target, force, progress)
    if verify:
        problems = model_store.verify(artifact, progress)
        if problems:
            fix = (
                f"hybridllm model pull --force {source_uri}"
                if artifact.manifest.artifact == store.SOURCE
                else f"hybridllm model convert {source_uri} --to {target} --force"
            )
            raise errors.IntegrityError(
                f"{artifact.path} is corrupt and was not loaded: {'; '.join(problems)}. "
                f"Rebuild it with `{fix}`"
            )
    return artifact


def _ensure(
    model_store: store.Store, source: Artifact, target: str, force: bool, progress: Progress
) -> Artifact:
    is_gguf = source.manifest.format == "gguf"
    if target == store.SOURCE or (target == "gguf" and is_gguf):
        return source
    if target == "gguf":
        return _ensure(model_store, source, "gguf-f16", force, progress)
    if target == "hf" and not is_gguf:
        return source
    parent_target, recipe = RECIPES[target]
    parent = _ensure(model_store, source, parent_target, False, progress)
    # The fp32 root every reference is computed from: the artifact itself when it is `hf`.
    hf = None if target == "hf" else _ensure(model_store, source, "hf", False, progress)

    def build(staging: Path) -> Built:
        built = recipe(parent.primary_path, staging, progress)
        hf_dir = staging if hf is None else hf.primary_path
        reference = fp32_reference(hf_dir, built.quantization, progress)
        return dataclasses.replace(built, reference=reference)

    log.debug("building %s from %s", target, parent.path)
    return model_store.build_artifact(
        source.manifest.name,
        source.manifest.revision,
        target,
        build,
        source_uri=source.manifest.source_uri,
        derived_from_sha256=source.content_sha256,
        recipe=recipe_id(target),
        force=force,
        progress=progress,
    )


def ensure(
    source_uri: str = uri.DEFAULT_URI,
    target: str = "hf",
    *,
    model_store: store.Store | None = None,
    force: bool = False,
    verify: bool = False,
    expected_sha256: str | None = None,
    progress: Progress = NULL,
) -> Path:
    """Path to load: the .gguf file for GGUF targets, the folder for hf and onnx targets."""
    return ensure_artifact(
        source_uri,
        target,
        model_store=model_store,
        force=force,
        verify=verify,
        expected_sha256=expected_sha256,
        progress=progress,
    ).primary_path
