"""The manifest of one stored artifact, and hashing.

Every artifact directory (``<root>/<name>/<revision>/<artifact>/``) holds ``manifest.json``,
written last: a directory without one is incomplete and is never used. The manifest lists
every file with its size and sha256, so ``verify`` can re-hash, and the sha256 of the source
file the artifact was derived from, so a conversion is cached by (source sha256, target).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import pydantic

from hybridllm_models import quality

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
_CHUNK = 4 << 20

Format = Literal["gguf", "safetensors", "onnx"]


class FileEntry(pydantic.BaseModel):
    path: str = pydantic.Field(description="path relative to the artifact directory")
    size: int
    sha256: str


class Manifest(pydantic.BaseModel):
    schema_version: int = SCHEMA_VERSION
    name: str
    revision: str
    artifact: str = pydantic.Field(
        description="'source' or a conversion target such as 'gguf-q8_0'"
    )
    source_uri: str
    format: Format
    quantization: str = pydantic.Field(description="e.g. Q4_1, f32, bf16, f16, Q8_0, Q4_K_M, int8")
    parameter_count: int
    primary: str = pydantic.Field(description="the file (or '.' for the directory) runtimes load")
    files: list[FileEntry]
    derived_from_sha256: str = pydantic.Field(
        "", description="sha256 of the source's primary file this artifact was converted from"
    )
    created_at: str = ""
    tool: str = ""
    recipe: str = pydantic.Field(
        "",
        description="the conversion recipe and its version (e.g. 'onnx-int8/2 ...'); an "
        "artifact built by another version of its recipe is rebuilt",
    )
    reference: quality.Reference | None = pydantic.Field(
        None,
        description="fp32 reference outputs on fixed prompts and this variant's tolerance; "
        "runtimes and `verify` compare their own outputs against them",
    )

    def file(self, rel: str) -> FileEntry:
        for entry in self.files:
            if entry.path == rel:
                return entry
        raise KeyError(rel)

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def describe_files(
    directory: Path, progress: Callable[[int], None] | None = None
) -> list[FileEntry]:
    """Hash every regular file under directory (except the manifest), sorted by path."""
    entries = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST_NAME:
            continue
        entries.append(
            FileEntry(path=rel, size=path.stat().st_size, sha256=sha256_file(path, progress))
        )
    return entries


def read(directory: Path) -> Manifest:
    return Manifest.model_validate_json((directory / MANIFEST_NAME).read_text())


def write(directory: Path, manifest: Manifest) -> None:
    """Write the manifest atomically (temp file, fsync, rename)."""
    write_text_atomic(directory / MANIFEST_NAME, manifest.model_dump_json(indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
