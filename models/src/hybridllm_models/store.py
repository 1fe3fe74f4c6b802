"""The model store: ``<root>/<name>/<revision>/<artifact>/`` directories, each with a manifest.

``<artifact>`` is ``source`` (what ``pull`` fetched) or a conversion target (``hf``,
``gguf-q8_0``, ...). The root is ``~/.cache/hybridllm/models`` unless ``HYBRIDLLM_MODEL_CACHE``
says otherwise.

Consistency rules, which every writer follows through ``build_artifact``:

- An artifact is built in a staging directory next to its final place
  (``.tmp-<artifact>-<random>``), hashed, its manifest written last, then renamed into place.
  A reader never sees half an artifact; a crash leaves only a staging directory, which the
  next builder of that artifact removes.
- One ``filelock`` per artifact (``.<artifact>.lock`` beside it) serialises builders across
  processes: the second process to ask waits, then finds the artifact built and reuses it.
- "Present" means: the manifest parses and every file it lists exists with its recorded
  size. That check is cheap and runs on every use; ``verify`` re-hashes every byte.

This module needs numpy and gguf (for validating GGUF files) but never torch.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock

from hybridllm_models import errors, manifest, quality, sources, uri
from hybridllm_models.manifest import Manifest
from hybridllm_models.progress import NULL, Progress

log = logging.getLogger(__name__)

SOURCE = "source"
CACHE_ENV = "HYBRIDLLM_MODEL_CACHE"
# Set where the store was filled beforehand (a pod mounting a model volume): a source that
# is not in it is an error that says how to fill it, never a fetch from the network.
OFFLINE_ENV = "HYBRIDLLM_MODEL_OFFLINE"


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").lower() in ("1", "true", "yes", "on")


def default_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "hybridllm" / "models"


@dataclasses.dataclass(frozen=True)
class Built:
    """What a build function reports about the files it wrote into the staging directory."""

    format: manifest.Format
    quantization: str
    parameter_count: int
    primary: str
    reference: quality.Reference | None = None


@dataclasses.dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: Manifest

    @property
    def primary_path(self) -> Path:
        return self.path if self.manifest.primary == "." else self.path / self.manifest.primary

    @property
    def content_sha256(self) -> str:
        """sha256 of the primary file; for a folder, of its files' names and hashes."""
        if self.manifest.primary != ".":
            return self.manifest.file(self.manifest.primary).sha256
        digest = hashlib.sha256()
        for entry in self.manifest.files:
            digest.update(f"{entry.path}:{entry.sha256}\n".encode())
        return digest.hexdigest()


class Store:
    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or default_root()).resolve()

    def artifact_dir(self, name: str, revision: str, artifact: str) -> Path:
        return self.root / name / revision / artifact

    def lock(self, name: str, revision: str, artifact: str) -> filelock.FileLock:
        parent = self.root / name / revision
        parent.mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(parent / f".{artifact}.lock")

    def load(self, name: str, revision: str, artifact: str) -> Artifact | None:
        """The artifact if present and complete (manifest valid, files at their recorded sizes)."""
        path = self.artifact_dir(name, revision, artifact)
        if not (path / manifest.MANIFEST_NAME).is_file():
            return None
        try:
            found = manifest.read(path)
        except (ValueError, OSError) as exc:
            log.warning("ignoring %s: unreadable manifest (%s)", path, exc)
            return None
        for entry in found.files:
            file = path / entry.path
            if not file.is_file() or file.stat().st_size != entry.size:
                log.warning("ignoring %s: %s is missing or has the wrong size", path, entry.path)
                return None
        return Artifact(path, found)

    def build_artifact(
        self,
        name: str,
        revision: str,
        artifact: str,
        build: Callable[[Path], Built],
        *,
        source_uri: str,
        derived_from_sha256: str = "",
        recipe: str = "",
        force: bool = False,
        check: Callable[[Artifact], None] | None = None,
        progress: Progress = NULL,
    ) -> Artifact:
        """Return the artifact, building it under its lock if absent, stale or forced.

        ``check`` runs on the finished staging directory before it is published; it raises
        to refuse it (e.g. a sha256 the caller expected), leaving the store as it was. An
        artifact built from another source, or by another ``recipe`` (version), is rebuilt.
        """
        final = self.artifact_dir(name, revision, artifact)
        lock = self.lock(name, revision, artifact)
        try:
            lock.acquire(timeout=0.05)
        except filelock.Timeout:
            log.info("waiting for another process building %s", final)
            lock.acquire()
        try:
            existing = self.load(name, revision, artifact)
            if existing is not None and not force:
                if existing.manifest.derived_from_sha256 != derived_from_sha256:
                    log.info("%s was built from another source; rebuilding", final)
                elif existing.manifest.recipe != recipe:
                    log.warning(
                        "%s was built by recipe %r, not %r; rebuilding",
                        final,
                        existing.manifest.recipe,
                        recipe,
                    )
                else:
                    return existing
            self._remove_staging(final)
            staging = final.parent / f".tmp-{artifact}-{uuid.uuid4().hex[:12]}"
            staging.mkdir()
            try:
                built = build(staging)
                total = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
                files = manifest.describe_files(staging, progress.task(f"sha256 {artifact}", total))
                record = Manifest(
                    name=name,
                    revision=revision,
                    artifact=artifact,
                    source_uri=source_uri,
                    format=built.format,
                    quantization=built.quantization,
                    parameter_count=built.parameter_count,
                    primary=built.primary,
                    files=files,
                    derived_from_sha256=derived_from_sha256,
                    created_at=datetime.datetime.now(datetime.UTC).isoformat(),
                    tool="hybridllm-models",
                    recipe=recipe,
                    reference=built.reference,
                )
                if check is not None:
                    check(Artifact(staging, record))
                manifest.write(staging, record)
                self._publish(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return Artifact(final, record)
        finally:
            lock.release()

    def _remove_staging(self, final: Path) -> None:
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            log.warning("removing %s left by an interrupted build", stale)
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def _publish(staging: Path, final: Path) -> None:
        trash = None
        if final.exists():
            trash = final.parent / f".trash-{final.name}-{uuid.uuid4().hex[:12]}"
            os.rename(final, trash)
        os.rename(staging, final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def pull(
        self,
        source_uri: str,
        *,
        expected_sha256: str | None = None,
        force: bool = False,
        progress: Progress = NULL,
    ) -> Artifact:
        """Fetch a source into the store (once); its primary is a GGUF file or an HF folder."""
        source = uri.parse(source_uri)
        content = ""
        if source.scheme == "file":
            assert source.path is not None
            content = sources.local_content_sha256(source.path)
        name, revision = source.name, source.revision(content)

        def build(staging: Path) -> Built:
            if offline():
                raise errors.SourceNotFoundError(
                    f"{source_uri} is not in the model store at {self.root}, and {OFFLINE_ENV} "
                    f"says not to fetch it: fill the store first (HYBRIDLLM_MODEL_CACHE="
                    f"<the volume> hybridllm model pull {source_uri})"
                )
            primary = sources.fetch(source, staging, progress)
            fmt, quant, num_params = sources.summarize(staging, primary)
            return Built(
                format=fmt, quantization=quant, parameter_count=num_params, primary=primary
            )  # type: ignore[arg-type]

        def check(candidate: Artifact) -> None:
            if expected_sha256 and candidate.content_sha256 != expected_sha256.lower():
                raise errors.IntegrityError(
                    f"{source_uri}: sha256 is {candidate.content_sha256}, "
                    f"expected {expected_sha256}"
                )

        existing = self.load(name, revision, SOURCE)
        if existing is not None and existing.manifest.source_uri != source_uri:
            raise errors.ModelStoreError(
                f"{self.artifact_dir(name, revision, SOURCE)} already holds "
                f"{existing.manifest.source_uri}, not {source_uri}"
            )
        if existing is not None and not force:
            check(existing)
        return self.build_artifact(
            name,
            revision,
            SOURCE,
            build,
            source_uri=source_uri,
            force=force,
            check=check,
            progress=progress,
        )

    def artifacts(self) -> Iterator[Artifact]:
        """Every complete artifact in the store, sorted by name, revision, artifact."""
        if not self.root.is_dir():
            return
        for found in sorted(self.root.glob(f"*/*/*/{manifest.MANIFEST_NAME}")):
            name, revision, artifact = found.parent.relative_to(self.root).parts
            loaded = self.load(name, revision, artifact)
            if loaded is not None:
                yield loaded

    def verify(self, artifact: Artifact, progress: Progress = NULL) -> list[str]:
        """Re-hash every file of an artifact; return the problems found (empty when intact)."""
        problems = []
        advance = progress.task(
            f"verify {artifact.manifest.name}/{artifact.manifest.artifact}",
            artifact.manifest.total_size,
        )
        for entry in artifact.manifest.files:
            path = artifact.path / entry.path
            if not path.is_file():
                problems.append(f"{entry.path}: missing")
                continue
            size = path.stat().st_size
            if size != entry.size:
                problems.append(f"{entry.path}: size {size}, manifest says {entry.size}")
                advance(entry.size)
                continue
            digest = manifest.sha256_file(path, advance)
            if digest != entry.sha256:
                problems.append(f"{entry.path}: sha256 {digest}, manifest says {entry.sha256}")
        return problems

    def remove(self, artifact: Artifact) -> None:
        """Delete one artifact under its lock (the manifest first, so it is never half-present)."""
        name, revision, target = artifact.path.relative_to(self.root).parts
        with self.lock(name, revision, target):
            (artifact.path / manifest.MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(artifact.path, ignore_errors=True)
