"""``hybridllm model {pull,convert,list,verify,path}``: the store from the command line.

Progress bars come from rich (on stderr); each artifact touched gets one summary line on
stdout, so scripts can read it. Errors of the store print as one line and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_models import convert, errors, store, uri
from hybridllm_models.progress import Advance, Progress

log = logging.getLogger(__name__)


class RichProgress:
    """Rich bars on stderr, started on the first task (a cached artifact draws nothing)."""

    def __init__(self) -> None:
        self._bars: Any = None

    def task(self, description: str, total: int | None) -> Advance:
        if self._bars is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bars

            self._bars = Bars(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bars.start()
        bars = self._bars
        task_id = bars.add_task(description, total=total)

        def advance(n: int) -> None:
            bars.advance(task_id, n)

        return advance

    def stop(self) -> None:
        if self._bars is not None:
            self._bars.stop()


@contextmanager
def rich_progress() -> Iterator[Progress]:
    progress = RichProgress()
    try:
        yield progress
    finally:
        progress.stop()


def summary(artifact: store.Artifact) -> str:
    m = artifact.manifest
    return (
        f"{m.name}/{m.revision}/{m.artifact}  {m.format} {m.quantization}  "
        f"{m.parameter_count / 1e6:.1f}M params  {m.total_size / 1e6:.1f} MB  "
        f"{artifact.primary_path}"
    )


def _pull(args: argparse.Namespace) -> int:
    with rich_progress() as progress:
        artifact = store.Store().pull(
            args.uri, expected_sha256=args.sha256, force=args.force, progress=progress
        )
    print(summary(artifact))
    return 0


def _convert(args: argparse.Namespace) -> int:
    for target in args.to:
        with rich_progress() as progress:
            artifact = convert.ensure_artifact(
                args.uri, target, force=args.force, progress=progress
            )
        print(summary(artifact))
    return 0


def _path(args: argparse.Namespace) -> int:
    print(convert.ensure(args.uri, args.to))
    return 0


def _selected(selector: str | None) -> list[store.Artifact]:
    found = list(store.Store().artifacts())
    if selector:
        found = [
            a
            for a in found
            if "/".join((a.manifest.name, a.manifest.revision, a.manifest.artifact)).startswith(
                selector
            )
        ]
    return found


def _list(args: argparse.Namespace) -> int:
    found = _selected(args.selector)
    if not found:
        print(f"no models in {store.Store().root}", file=sys.stderr)
    for artifact in found:
        print(summary(artifact))
    return 0


def _verify(args: argparse.Namespace) -> int:
    found = _selected(args.selector)
    if not found:
        print(f"no models to verify in {store.Store().root}", file=sys.stderr)
        return 1
    num_bad = 0
    with rich_progress() as progress:
        results = [(a, store.Store().verify(a, progress)) for a in found]
    for artifact, problems in results:
        if not problems and not args.hash_only:
            problems = _quality_problems(artifact)
        state = "ok" if not problems else "FAILED: " + "; ".join(problems)
        print(f"{summary(artifact)}  {state}")
        num_bad += bool(problems)
    if num_bad:
        print(f"{num_bad} artifact(s) failed; rebuild them with convert --force", file=sys.stderr)
    return 1 if num_bad else 0


def _quality_problems(artifact: store.Artifact) -> list[str]:
    from hybridllm_models import quality, verify

    try:
        result = verify.check_quality(artifact)
    except quality.QualityError as exc:
        return [str(exc)]
    if result is not None:
        print(f"  quality: {result.describe()}", file=sys.stderr)
    return []


def _run(func: Any) -> Any:
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except errors.ModelStoreError as exc:
            log.debug("model command failed", exc_info=True)
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return wrapped


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("model", help=common_cli.summary("model"))
    commands = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    pull = commands.add_parser("pull", help="fetch a model into the store")
    pull.add_argument(
        "uri", nargs="?", default=uri.DEFAULT_URI, help=f"source URI (default {uri.DEFAULT_URI})"
    )
    pull.add_argument("--sha256", help="refuse the file unless it has this sha256")
    pull.add_argument("--force", action="store_true", help="fetch again even if present")
    pull.set_defaults(func=_run(_pull))

    conv = commands.add_parser("convert", help="convert a pulled model (pulls it first if needed)")
    conv.add_argument("uri", nargs="?", default=uri.DEFAULT_URI, help="source URI")
    conv.add_argument(
        "--to",
        required=True,
        action="append",
        choices=convert.TARGETS,
        help="target format (repeatable)",
    )
    conv.add_argument("--force", action="store_true", help="rebuild the target even if cached")
    conv.set_defaults(func=_run(_convert))

    path = commands.add_parser("path", help="print the path of a target (building it if needed)")
    path.add_argument("uri", nargs="?", default=uri.DEFAULT_URI, help="source URI")
    path.add_argument("--to", default="gguf", choices=(*convert.TARGETS, store.SOURCE))
    path.set_defaults(func=_run(_path))

    for name, func, help_text in (
        ("list", _list, "list stored artifacts"),
        (
            "verify",
            _verify,
            "re-hash stored artifacts against their manifests and run each converted "
            "artifact on fixed prompts against its fp32 reference outputs",
        ),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("selector", nargs="?", help="NAME[/REVISION[/ARTIFACT]] prefix")
        if name == "verify":
            sub.add_argument(
                "--hash-only", action="store_true", help="re-hash only; skip the quality check"
            )
        sub.set_defaults(func=_run(func))
