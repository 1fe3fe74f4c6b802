"""Backend choice from settings: ``llamacpp`` (GGUF) or ``onnx`` (export with past key/values).

A backend loaded from a converted artifact is checked before it serves: it runs the fixed
prompts of the artifact's manifest through its own ``forward`` (one token a step, the path
decoding takes) and is refused (``quality.QualityError``) when its next-token
distributions are too far from the fp32 reference's (``hybridllm_models.quality``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hybridllm_edge import config
from hybridllm_edge.backends.base import Backend, BackendInfo, SlotWork
from hybridllm_models import manifest, quality
from hybridllm_models.manifest import Manifest

log = logging.getLogger(__name__)

__all__ = ["Backend", "BackendInfo", "SlotWork", "load", "resolve_model", "teacher_forced_logits"]


def resolve_model(settings: config.EdgeSettings) -> tuple[Path, str, Manifest | None]:
    """Path to load, its revision and its manifest (a local file/folder as is, or the store's)."""
    local = Path(settings.model)
    if local.exists():
        stat = local.stat()  # a changed file is another revision (and another cache key)
        revision = f"local/{local.resolve()}/{stat.st_size}/{stat.st_mtime_ns}"
        folder = local if local.is_dir() else local.parent
        if not (folder / manifest.MANIFEST_NAME).is_file():
            return local, revision, None
        found = manifest.read(folder)  # a store artifact given by its path
        primary = "." if local.is_dir() else local.name
        return local, revision, found if found.primary == primary else None
    import hybridllm_models

    artifact = hybridllm_models.ensure_artifact(
        settings.model,
        target=settings.store_target(),
        verify=settings.verify_model,
        expected_sha256=settings.model_sha256,
    )
    m = artifact.manifest
    digest = next((f.sha256 for f in m.files if f.path == m.primary), "")
    if not digest:  # a folder artifact: the files together
        digest = "".join(sorted(f.sha256 for f in m.files))
    revision = f"{m.name}@{m.revision}/{m.artifact}/{digest[:16]}"
    log.info("model %s (%s) -> %s", settings.model, settings.store_target(), artifact.primary_path)
    return artifact.primary_path, revision, m


def load(settings: config.EdgeSettings) -> Backend:
    """The backend, loaded and checked against its reference outputs (QualityError if off)."""
    path, revision, found = resolve_model(settings)
    backend: Backend
    if settings.backend == "llamacpp":
        from hybridllm_edge.backends import llamacpp

        backend = llamacpp.LlamaCppBackend(path, revision, settings)
    else:
        from hybridllm_edge.backends import onnx

        backend = onnx.OnnxBackend(path, revision, settings)
    if found is None or found.reference is None:
        log.warning("%s has no reference outputs in a manifest: quality check skipped", path)
        return backend
    what = f"{path} ({found.format} {found.quantization}, {settings.backend})"
    try:
        result = quality.check(
            found.reference,
            lambda ids: teacher_forced_logits(backend, ids),
            what,
            found.artifact,
        )
    except BaseException:
        backend.close()
        raise
    log.info("%s passed its quality check: %s", what, result.describe())
    return backend


def teacher_forced_logits(backend: Backend, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] after each token, fed one a step in slot 0, then released."""
    rows = []
    try:
        for pos, token in enumerate(ids):
            rows.append(backend.forward([SlotWork(0, [token], pos, want_logits=True)])[0])
    finally:
        backend.release(0)
    return np.stack(rows)
