"""The `hybridllm` command: one entry point, subcommands contributed by the installed distributions.

Each distribution registers a function under the entry-point group ``hybridllm.cli``
(``crds = "hybridllm_operator.cli:register_crds"``). The function receives the
subparsers object, adds its subcommand and sets ``func`` on it; ``func(args)`` returns
the exit code. A subcommand whose distribution is not installed simply does not appear,
so the edge image, which carries no operator, still has a working `hybridllm`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hybridllm.cli"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridllm",
        description="hybridllm: one LLM service across edge devices and cloud GPUs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry_point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            register: Callable[[Any], None] = entry_point.load()
        except ImportError as exc:
            log.warning("subcommand %r unavailable: %s", entry_point.name, exc)
            continue
        register(subparsers)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def run_standalone(
    prog: str,
    description: str | None,
    add_commands: Callable[[Any], None],
    argv: Sequence[str] | None = None,
) -> int:
    """The body of a distribution's own command (`hybridllm-cloud`, `hybridllm-edge`, ...).

    ``add_commands`` is the same function the distribution uses under `hybridllm NAME`, so
    both spellings take the same subcommands and flags.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=LOG_FORMAT,
    )
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
