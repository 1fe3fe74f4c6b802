#!/usr/bin/env python3
"""Build hybridllm's container images from ``docker/*.Dockerfile`` without a Docker engine,
as OCI archives that ``ctr images import`` (containerd) and ``skopeo``/``podman load`` read.

    python hack/images/oci.py build gateway runtime-edge     # prints NAME DIGEST ARCHIVE
    python hack/images/oci.py build --all
    python hack/images/oci.py list

Why a builder of our own rather than buildah or umoci: no registry is reachable here, so
the Dockerfiles' ``FROM python:3.11-slim-bookworm`` cannot be pulled, and every ``RUN``
would need a container runtime with network access to PyPI. The steps our Dockerfiles take
are few and known, so this builder performs each of them natively and refuses any other:

- the base (``python:3.11-slim-bookworm``, and ``apt-get install`` in the final stage)
  becomes a Debian bookworm root file system made by ``mmdebstrap`` from Debian's packages,
  with Debian's python3.11 (the interpreter the Dockerfiles' base image also ships);
- ``uv sync --frozen --no-dev --no-editable --package P`` runs on this machine, into a
  relocatable virtual environment built against that same Debian python3.11 (the host is
  bookworm too), from uv's wheel cache, and becomes ``/opt/hybridllm``;
- ``useradd`` and ``mkdir``/``chown`` of the model cache become file entries;
- ``ENV``, ``USER`` and ``ENTRYPOINT`` become the image configuration.

An image is streamed into containerd (``ctr images import -``) or written as an archive
with ``archive``. Layers are uncompressed tars written deterministically (sorted, mtime 0), so an unchanged
input gives the same digest: the base layer and the third-party part of the environment
(torch, for the cloud runtime: gigabytes) are cached by the hash of what made them, and
only the layer holding our own packages changes with the source. Archives and their layer
caches live in ``~/.cache/hybridllm/images``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
CACHE = Path(os.environ.get("HYBRIDLLM_IMAGE_CACHE", Path.home() / ".cache/hybridllm/images"))
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("HYBRIDLLM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the Dockerfiles' base image (python:3.11-slim-bookworm) gives a program at run time.
BASE_PACKAGES = ("python3.11", "ca-certificates", "tzdata")
BASE_IMAGE = "python:3.11-slim-bookworm"
HOST_PYTHON = "/usr/bin/python3.11"  # Debian's, the same package as in the base layer
VENV = "/opt/hybridllm"
WORKSPACE_PREFIXES = ("hybridllm_", "hybridllm-", "_hybridllm")  # our own packages' files
VERSION = "0.1.0"
LAYER = "application/vnd.oci.image.layer.v1.tar"
LOCK = ROOT / "uv.lock"


class BuildError(RuntimeError):
    """An image could not be built; the message names the step and the cause."""


def log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _hash(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


# --- the Dockerfile, read strictly ------------------------------------------------------


@dataclasses.dataclass
class Recipe:
    """What a Dockerfile asks for, in the terms this builder can carry out."""

    name: str  # the component, from the file name: gateway, runtime-edge, ...
    package: str  # the workspace member that `uv sync --package` installs
    apt: tuple[str, ...]  # packages the final stage installs with apt-get
    env: dict[str, str]
    user: str
    entrypoint: list[str]
    uid: int = 10001
    home: str = "/home/hybridllm"
    owned_dirs: tuple[str, ...] = ()

    @property
    def image(self) -> str:
        # What `docker build -t hybridllm/NAME:VERSION` names it, and what the operator runs.
        return f"docker.io/hybridllm/{self.name}:{VERSION}"


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, rest = logical.partition(" ")
        yield keyword.upper(), rest.strip()
        logical = ""


def read_dockerfile(path: Path) -> Recipe:
    """Parse one of our Dockerfiles; refuse any instruction this builder does not carry out,
    so that a Dockerfile change the builder would silently drop fails here instead."""
    name = path.name.removesuffix(".Dockerfile")
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in _instructions(path.read_text()):
        if keyword == "FROM":
            image = rest.split()[0]
            if image != BASE_IMAGE:
                raise BuildError(f"{path.name}: FROM {image}: only {BASE_IMAGE} is supported")
            stages.append([])
            continue
        if not stages:
            raise BuildError(f"{path.name}: {keyword} before FROM")
        stages[-1].append((keyword, rest))
    if len(stages) != 2:
        raise BuildError(
            f"{path.name}: expected a build stage and a final stage, found {len(stages)}"
        )
    package = ""
    for keyword, rest in stages[0]:
        if keyword == "RUN" and (m := re.search(r"uv sync .*--package (\S+)", rest)):
            package = m.group(1)
        elif keyword not in ("RUN", "ENV", "WORKDIR", "COPY"):
            raise BuildError(
                f"{path.name}: build stage: {keyword} is not supported by this builder"
            )
    if not package:
        raise BuildError(f"{path.name}: the build stage has no `uv sync --package NAME`")
    apt: list[str] = []
    env: dict[str, str] = {}
    user, entrypoint, owned = "", [], []
    for keyword, rest in stages[1]:
        if keyword == "RUN":
            for command in (c.strip() for c in rest.split("&&")):
                words = shlex.split(command)
                if words[:2] == ["apt-get", "install"]:
                    apt += [w for w in words[2:] if not w.startswith("-")]
                elif words[:2] == ["apt-get", "update"] or words[:2] == ["rm", "-rf"]:
                    continue
                elif words and words[0] == "useradd":
                    if "10001" not in words or words[-1] != "hybridllm":
                        raise BuildError(f"{path.name}: useradd other than uid 10001 `hybridllm`")
                elif words[:2] == ["mkdir", "-p"]:
                    owned += words[2:]
                elif words and words[0] == "chown":
                    continue  # the directories made above belong to the user (see build_image)
                else:
                    raise BuildError(
                        f"{path.name}: RUN {command!r} is not supported by this builder"
                    )
        elif keyword == "COPY":
            if VENV not in rest:
                raise BuildError(
                    f"{path.name}: COPY {rest}: only the environment at {VENV} is supported"
                )
        elif keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        elif keyword == "USER":
            user = rest
        elif keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        else:
            raise BuildError(f"{path.name}: {keyword} is not supported by this builder")
    if user != "10001" or not entrypoint:
        raise BuildError(f"{path.name}: the final stage must set USER 10001 and an ENTRYPOINT")
    if "PATH" in env:
        env["PATH"] = env["PATH"].replace(
            "$PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        )
    return Recipe(name, package, tuple(apt), env, user, entrypoint, owned_dirs=tuple(owned))


def recipes() -> dict[str, Recipe]:
    return {
        r.name: r for r in (read_dockerfile(p) for p in sorted(DOCKER_DIR.glob("*.Dockerfile")))
    }


# --- layers -----------------------------------------------------------------------------


def _normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uname = info.gname = ""
    return info


def write_layer(
    out: Path, entries: Iterable[tuple[str, Path | bytes | None, int, int | None]]
) -> str:
    """A deterministic tar of (path in image, source file/dir/link or bytes or None for a
    directory, mode (-1: the file's), owner (None: the file's)); returns its sha256 (layers
    are uncompressed: digest = diff id)."""
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, source, mode, uid in sorted(entries, key=lambda e: e[0]):
            arcname = name.lstrip("/")
            if isinstance(source, Path):
                info = tar.gettarinfo(str(source), arcname)
                if uid is not None:
                    info.uid = info.gid = uid
                info.mode = mode if mode >= 0 else info.mode
                _normalize(info)
                if info.isreg():
                    with source.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
            else:
                info = tarfile.TarInfo(arcname)
                info.uid = info.gid = uid
                info.mode = mode
                if source is None:
                    info.type = tarfile.DIRTYPE
                    tar.addfile(_normalize(info))
                else:
                    info.size = len(source)
                    tar.addfile(_normalize(info), io.BytesIO(source))
    tmp.rename(out)
    return _sha256_file(out)


def _tree(
    root: Path, prefix: str, keep: Callable[[Path], bool], uid: int | None = 0
) -> Iterator[tuple[str, Path, int, int | None]]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames.sort()
        for name in [*dirnames, *sorted(filenames)]:
            path = here / name
            rel = path.relative_to(root)
            if keep(rel):
                yield f"{prefix}/{rel}", path, -1, uid


def _cached(key_name: str, make: Callable[[Path], str]) -> tuple[Path, str]:
    """A layer cached under its key: (tar path, sha256)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path, meta = CACHE / f"{key_name}.tar", CACHE / f"{key_name}.sha256"
    if path.exists() and meta.exists():
        return path, meta.read_text().strip()
    digest = make(path)
    meta.write_text(digest)
    # Keys are "<kind>-<recipe>-<hash>": an older layer of the same kind and recipe is
    # replaced, so the cache holds one torch layer, not one per lock file ever built.
    family = key_name.rsplit("-", 1)[0] + "-"
    for old in CACHE.glob(f"{family}*") if key_name.startswith(("deps-", "app-")) else ():
        if (
            old.stem != key_name
            and old.suffix in (".tar", ".sha256")
            and old.stem.count("-") == key_name.count("-")
        ):
            old.unlink(missing_ok=True)
    return path, digest


def base_layer(apt: tuple[str, ...]) -> tuple[Path, str]:
    """Debian bookworm with python3.11 and the final stage's apt packages, by mmdebstrap."""
    packages = tuple(sorted({*BASE_PACKAGES, *apt}))
    key = f"base-{DEBIAN_SUITE}-{_hash(DEBIAN_MIRROR, *packages)}"

    def make(out: Path) -> str:
        if shutil.which("mmdebstrap") is None:
            raise BuildError(
                "mmdebstrap is required for the base layer (Debian: apt-get install mmdebstrap)"
            )
        log(
            f"base layer: mmdebstrap {DEBIAN_SUITE} with {', '.join(packages)} (first build: ~2 min)"
        )
        raw = out.with_suffix(".mmdebstrap.tar")
        env = {**os.environ, "SOURCE_DATE_EPOCH": "0"}
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(packages)}",
             "--aptopt=Acquire::Retries=3", "--dpkgopt=path-exclude=/usr/share/{doc,man,locale}/*",
             DEBIAN_SUITE, str(raw), DEBIAN_MIRROR],
            check=True, env=env,
        )  # fmt: skip
        # Re-write it deterministically (mmdebstrap's tar keeps install-time mtimes).
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            subprocess.run(["tar", "-C", tmp, "--numeric-owner", "-xpf", str(raw)], check=True)
            raw.unlink()
            # The whole root file system, keeping owners, modes, links and devices.
            return write_layer(out, _tree(Path(tmp), "", lambda _: True, uid=None))

    return _cached(key, make)


def build_venv(recipe: Recipe, target: Path) -> None:
    """`uv sync` of the recipe's package into a relocatable environment for Debian's
    python3.11, from uv's cache (the wheels `make setup` already fetched or built)."""
    if not Path(HOST_PYTHON).exists():
        raise BuildError(
            f"{HOST_PYTHON} (Debian's python3.11, as in the image) is required on this machine"
        )
    if target.exists():
        shutil.rmtree(target)
    env = {
        **os.environ,
        "UV_PROJECT_ENVIRONMENT": str(target),
        "UV_PYTHON": HOST_PYTHON,
        "UV_COMPILE_BYTECODE": "1",
        "UV_LINK_MODE": "hardlink",  # the layers read the bytes; no second copy on disk
        "UV_PYTHON_DOWNLOADS": "never",
    }
    subprocess.run(
        ["uv", "venv", "--quiet", "--relocatable", "--python", HOST_PYTHON, str(target)],
        check=True,
        env=env,
        cwd=ROOT,
    )
    sync = [
        "uv",
        "sync",
        "--quiet",
        "--frozen",
        "--no-dev",
        "--no-editable",
        "--package",
        recipe.package,
    ]
    # uv caches the wheels it builds from our own packages by their pyproject.toml only:
    # rebuild them, so the image carries the source as it is now.
    for member in _workspace_members():
        sync += ["--reinstall-package", member]
    if subprocess.run([*sync, "--offline"], env=env, cwd=ROOT, capture_output=True).returncode != 0:
        subprocess.run(sync, check=True, env=env, cwd=ROOT)


def _workspace_members() -> list[str]:
    import tomllib

    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = []
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        for member in sorted(ROOT.glob(pattern)):
            if (member / "pyproject.toml").is_file():
                project = tomllib.loads((member / "pyproject.toml").read_text())["project"]
                names.append(project["name"])
    return names


def _ours(rel: Path) -> bool:
    """Files of our own workspace packages (and their entry points) in the environment."""
    name = rel.parts[-1] if rel.parts else ""
    if len(rel.parts) >= 4 and rel.parts[:3] == ("lib", "python3.11", "site-packages"):
        return rel.parts[3].startswith(WORKSPACE_PREFIXES)
    return rel.parts[:1] == ("bin",) and name.startswith("hybridllm")


def _user_layer_entries(
    recipe: Recipe, base: Path
) -> list[tuple[str, Path | bytes | None, int, int]]:
    """/etc/passwd and /etc/group with the image's user appended, its home, its dirs."""
    with tarfile.open(base) as tar:
        passwd = tar.extractfile("etc/passwd").read()  # type: ignore[union-attr]
        group = tar.extractfile("etc/group").read()  # type: ignore[union-attr]
    passwd += f"hybridllm:x:{recipe.uid}:{recipe.uid}::{recipe.home}:/bin/sh\n".encode()
    group += f"hybridllm:x:{recipe.uid}:\n".encode()
    entries: list[tuple[str, Path | bytes | None, int, int]] = [
        ("/etc/passwd", passwd, 0o644, 0),
        ("/etc/group", group, 0o644, 0),
        (recipe.home, None, 0o755, recipe.uid),
    ]
    entries += [(d, None, 0o755, recipe.uid) for d in recipe.owned_dirs]
    return entries


def _source_hash(recipe: Recipe) -> str:
    files = sorted(
        p for p in ROOT.glob("*/src/**/*") if p.is_file() and "__pycache__" not in p.parts
    )
    files += sorted(ROOT.glob("*/pyproject.toml"))
    return _hash(
        *(f"{p.relative_to(ROOT)}:{_sha256_file(p)}" for p in files),
        LOCK.read_bytes(),
        recipe.package,
    )


@dataclasses.dataclass
class Built:
    """A built image: its layers (cached tars) and the small JSON documents naming them.
    It becomes an OCI archive only when streamed (to a file, or straight into containerd),
    so a multi-gigabyte layer is never copied into a second file."""

    name: str
    image: str
    layers: list[tuple[Path, str]]  # (tar, sha256)
    config: bytes
    manifest: bytes

    @property
    def digest(self) -> str:
        """The manifest's digest, as containerd lists the image."""
        return f"sha256:{hashlib.sha256(self.manifest).hexdigest()}"

    def save(self, path: Path) -> None:
        path.write_text(
            json.dumps(
                {
                    "name": self.name,
                    "image": self.image,
                    "layers": [[str(p), d] for p, d in self.layers],
                    "config": self.config.decode(),
                    "manifest": self.manifest.decode(),
                }
            )
        )

    @classmethod
    def load(cls, path: Path) -> Built | None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            raw = json.loads(path.read_text())
            layers = [(Path(p), d) for p, d in raw["layers"]]
            if all(p.exists() for p, _ in layers):
                return cls(
                    raw["name"],
                    raw["image"],
                    layers,
                    raw["config"].encode(),
                    raw["manifest"].encode(),
                )
        return None

    def write_archive(self, out: BinaryIO, present: frozenset[str] = frozenset()) -> None:
        """The image as an OCI image layout in a tar stream (what `ctr images import`,
        `podman load` and `skopeo copy oci-archive:` read). Layers whose digests are in
        `present` are left out: for a store that already holds them (containerd unpacks an
        image from its own content store, so a layer it has is never read from the stream),
        this keeps a new build from streaming gigabytes it already has."""
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": self.digest,
                    "size": len(self.manifest),
                    "annotations": {
                        "io.containerd.image.name": self.image,
                        "org.opencontainers.image.ref.name": self.image.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        small = {
            "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
            "index.json": json.dumps(index, sort_keys=True).encode(),
            f"blobs/sha256/{self.digest[7:]}": self.manifest,
            f"blobs/sha256/{hashlib.sha256(self.config).hexdigest()}": self.config,
        }
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for dirname in ("blobs", "blobs/sha256"):
                info = _normalize(tarfile.TarInfo(dirname))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            for name, data in small.items():
                info = _normalize(tarfile.TarInfo(name))
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            for path, digest in self.layers:
                if f"sha256:{digest}" in present:
                    continue
                info = _normalize(tarfile.TarInfo(f"blobs/sha256/{digest}"))
                info.size, info.mode = path.stat().st_size, 0o644
                with path.open("rb") as f:
                    tar.addfile(info, f)


def _assemble(
    name: str, image: str, config: dict[str, object], layers: list[tuple[Path, str]]
) -> Built:
    config_bytes = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": f"sha256:{hashlib.sha256(config_bytes).hexdigest()}",
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": LAYER, "digest": f"sha256:{d}", "size": p.stat().st_size}
            for p, d in layers
        ],
    }
    return Built(
        name,
        image,
        layers,
        config_bytes,
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode(),
    )


def build_image(recipe: Recipe) -> Built:
    """The recipe's image (cached by the hash of everything that made it)."""
    started = time.monotonic()
    base, base_digest = base_layer(recipe.apt)
    deps_key = f"deps-{recipe.name}-{_hash(LOCK.read_bytes(), recipe.package, HOST_PYTHON)}"
    # The builder itself is an input of the layer it writes last and of the image record.
    app_key = f"app-{recipe.name}-{_hash(_source_hash(recipe), _sha256_file(Path(__file__)))}"
    record = (
        CACHE
        / f"{recipe.name}-{_hash(base_digest, deps_key, app_key, json.dumps(dataclasses.asdict(recipe)))}.json"
    )
    if (built := Built.load(record)) is not None:
        return built
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        venv = Path(tmp) / "venv"
        log(f"{recipe.name}: uv sync --package {recipe.package} (from uv's cache)")
        build_venv(recipe, venv)
        deps, deps_digest = _cached(
            deps_key, lambda out: write_layer(out, _tree(venv, VENV, lambda r: not _ours(r)))
        )
        app, app_digest = _cached(
            app_key,
            lambda out: write_layer(
                out, [*_tree(venv, VENV, _ours), *_user_layer_entries(recipe, base)]
            ),
        )
    layers = [(base, base_digest), (deps, deps_digest), (app, app_digest)]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": [f"{k}={v}" for k, v in recipe.env.items()],
            "Entrypoint": recipe.entrypoint,
            "User": recipe.user,
            "WorkingDir": "/",
            "Labels": {"org.opencontainers.image.source": f"docker/{recipe.name}.Dockerfile"},
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{d}" for _, d in layers]},
        "history": [
            {"created_by": f"hack/images/oci.py: {what}"}
            for what in (
                f"mmdebstrap {DEBIAN_SUITE} {' '.join(sorted({*BASE_PACKAGES, *recipe.apt}))}",
                f"uv sync --package {recipe.package} (third-party)",
                f"uv sync --package {recipe.package} (hybridllm), user {recipe.uid}",
            )
        ],
    }
    built = _assemble(recipe.name, recipe.image, config, layers)
    for old in CACHE.glob(f"{recipe.name}-*.json"):
        old.unlink(missing_ok=True)
    built.save(record)
    size = sum(p.stat().st_size for p, _ in layers) / 1e6
    log(
        f"{recipe.name}: {recipe.image} {built.digest} in {time.monotonic() - started:.0f}s ({size:.0f} MB)"
    )
    return built


def pause_image(image: str) -> Built:
    """The pod sandbox image: Debian's catatonit (static), as `catatonit -P` (pause mode)."""
    binary = Path(shutil.which("catatonit") or "/usr/bin/catatonit")
    if not binary.exists():
        raise BuildError(
            "catatonit is required for the pause image (Debian: apt-get install catatonit)"
        )
    layer, digest = _cached(
        f"pause-{_hash(_sha256_file(binary))}",
        lambda out: write_layer(out, [("/pause", binary, 0o755, 0)]),
    )
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause", "-P"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{digest}"]},
    }
    return _assemble("pause", image, config, [(layer, digest)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="build images; prints NAME IMAGE DIGEST per image")
    build.add_argument("names", nargs="*", help="components (docker/NAME.Dockerfile)")
    build.add_argument("--all", action="store_true")
    archive = sub.add_parser("archive", help="build one image and write it as an OCI archive")
    archive.add_argument("name")
    archive.add_argument("-o", "--output", type=Path, required=True, help="the .tar to write")
    sub.add_parser("list", help="the images the Dockerfiles define")
    args = parser.parse_args(argv)
    try:
        known = recipes()
        if args.action == "list":
            for recipe in known.values():
                print(f"{recipe.name}\t{recipe.image}\t{recipe.package}")
            return 0
        if args.action == "archive":
            if args.name not in known:
                parser.error(f"unknown component {args.name!r}; known: {', '.join(known)}")
            built = build_image(known[args.name])
            with args.output.open("wb") as out:
                built.write_archive(out)
            print(f"{built.name}\t{built.image}\t{built.digest}\t{args.output}")
            return 0
        names = list(known) if args.all else args.names
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            parser.error(
                f"unknown component(s) {unknown}; known: {', '.join(known)}"
                if unknown
                else "name a component or pass --all"
            )
        for name in names:
            built = build_image(known[name])
            print(f"{built.name}\t{built.image}\t{built.digest}")
    except (BuildError, subprocess.CalledProcessError) as exc:
        log(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
