"""Backend choice from settings: ``llamacpp`` (GGUF) or ``onnx`` (export with past key/values)."""

from __future__ import annotations

import logging
from pathlib import Path

from hybridllm_edge import config
from hybridllm_edge.backends.base import Backend, BackendInfo, SlotWork

log = logging.getLogger(__name__)

__all__ = ["Backend", "BackendInfo", "SlotWork", "load", "resolve_model"]


def resolve_model(settings: config.EdgeSettings) -> tuple[Path, str]:
    """Path to load and its revision: a local file/folder as is, anything else via the store."""
    local = Path(settings.model)
    if local.exists():
        stat = local.stat()  # a changed file is another revision (and another cache key)
        return local, f"local/{local.resolve()}/{stat.st_size}/{stat.st_mtime_ns}"
    import hybridllm_models

    artifact = hybridllm_models.ensure_artifact(settings.model, target=settings.store_target())
    m = artifact.manifest
    digest = next((f.sha256 for f in m.files if f.path == m.primary), "")
    if not digest:  # a folder artifact: the files together
        digest = "".join(sorted(f.sha256 for f in m.files))
    revision = f"{m.name}@{m.revision}/{m.artifact}/{digest[:16]}"
    log.info("model %s (%s) -> %s", settings.model, settings.store_target(), artifact.primary_path)
    return artifact.primary_path, revision


def load(settings: config.EdgeSettings) -> Backend:
    path, revision = resolve_model(settings)
    if settings.backend == "llamacpp":
        from hybridllm_edge.backends import llamacpp

        return llamacpp.LlamaCppBackend(path, revision, settings)
    from hybridllm_edge.backends import onnx

    return onnx.OnnxBackend(path, revision, settings)
