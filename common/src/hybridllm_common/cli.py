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
import types
import typing
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, TypeVar

import pydantic

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hybridllm.cli"

# The commands of this repository's distributions, by group, with their one-line
# summaries: `hybridllm --help` lists the installed ones from here without importing any
# (as git lists its commands), and each command's own parser takes its summary from here.
# A command's module loads only when that command is chosen, so `hybridllm status` never
# pays for torch. A command another distribution adds that is not listed here is loaded
# to be listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("local mode", "run an LLMService manifest on this machine (local mode)"),
    "apply": (
        "local mode",
        "give a running local service a changed manifest (a new model revision rolls out)",
    ),
    "status": ("local mode", "a local service's processes"),
    "logs": ("local mode", "a local service's logs"),
    "down": ("local mode", "stop a local service (drain, then stop)"),
    "rollout": ("cluster", "see or steer the rollout of an LLMService's new model revision"),
    "operator": ("cluster", "run the Kubernetes operator"),
    "fleet": (
        "cluster",
        "the edge fleet server, device invitations, approval and bootstrap tokens",
    ),
    "crds": ("cluster", "generate the CustomResourceDefinitions"),
    "chart": ("cluster", "chores of the Helm chart (charts/hybridllm)"),
    "observability": ("cluster", "the metrics catalogue, Grafana dashboards and alerts"),
    "gateway": ("servers", "the OpenAI-compatible gateway"),
    "cloud": ("servers", "cloud runtime (our paged-KV engine)"),
    "edge": ("servers", "edge runtime (llama.cpp / onnxruntime) and agent"),
    "model": ("tools", "model store: pull, convert, list, verify"),
    "forecast": ("tools", "demand forecasting and scaling simulation"),
    "profile": ("tools", "measure what one replica of a pool sustains (its capacity block)"),
}


def summary(command: str) -> str:
    """The one-line help of a command of :data:`COMMANDS`."""
    return COMMANDS[command][1]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``hybridllm``: with ``only``, an installed command's name, that
    command's whole parser (its module imported, no other); without, the list of the
    installed commands, each from :data:`COMMANDS` (none imported)."""
    parser = argparse.ArgumentParser(
        prog="hybridllm",
        description="hybridllm: one LLM service across edge devices and cloud GPUs.",
        epilog="`hybridllm COMMAND --help` describes a command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    order = list(COMMANDS)  # by use: local mode, the cluster, the servers, the tools
    entry_points = sorted(
        metadata.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda e: (order.index(e.name) if e.name in COMMANDS else len(order), e.name),
    )
    chosen = [e for e in entry_points if e.name == only]
    for entry_point in chosen or entry_points:
        if not chosen and entry_point.name in COMMANDS:
            subparsers.add_parser(entry_point.name, help=summary(entry_point.name))
            continue
        try:
            register: Callable[[Any], None] = entry_point.load()
        except ImportError as exc:
            log.warning("subcommand %r unavailable: %s", entry_point.name, exc)
            continue
        register(subparsers)
    return parser


def _command_name(argv: Sequence[str]) -> str | None:
    """The subcommand in ``argv``: its first word that is not a global flag."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_group(subparsers: Any, name: str, add_commands: Callable[[Any], None]) -> None:
    """``hybridllm NAME COMMAND``: a distribution's commands under its name in
    :data:`COMMANDS`; ``add_commands`` is the function its own command
    (:func:`run_standalone`) takes them from."""
    group = subparsers.add_parser(name, help=summary(name))
    add_commands(group.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True))


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


SettingsT = TypeVar("SettingsT", bound=pydantic.BaseModel)


def add_settings_flags(
    parser: argparse.ArgumentParser, model: type[pydantic.BaseModel], env_prefix: str
) -> None:
    """One flag per field of a settings model (``max_num_seqs`` -> ``--max-num-seqs``).

    Every flag defaults to None, so a flag left out falls back to the environment
    (``{env_prefix}MAX_NUM_SEQS``) and then to the field's default: pydantic-settings'
    precedence. Booleans get ``--x/--no-x``, Literals become choices.
    """
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        base = args[0] if union and args else ann
        help_text = f"{field.description} (env {env_prefix}{name.upper()}, default {field.default})"
        if base is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(base), default=None, help=help_text)
        else:
            conv: Any = base if base in (int, float) else str
            parser.add_argument(flag, type=conv, default=None, help=help_text)


def settings_from_args(args: argparse.Namespace, model: type[SettingsT]) -> SettingsT:
    """The settings model from the flags that were given (raises pydantic.ValidationError)."""
    given = {k: v for k, v in vars(args).items() if k in model.model_fields and v is not None}
    return model(**given)


def add_serve(
    subparsers: Any,
    model: type[SettingsT],
    env_prefix: str,
    prog: str,
    serve: Callable[[SettingsT], int],
) -> None:
    """A runtime's ``serve`` subcommand: one flag per field of ``model``; ``serve(settings)``
    runs the server (imported there, so ``--help`` loads no server). Invalid flags are
    each named (:func:`report_invalid`), exit code 2."""
    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    add_settings_flags(parser, model, env_prefix)

    def run(args: argparse.Namespace) -> int:
        try:
            settings = settings_from_args(args, model)
        except pydantic.ValidationError as exc:
            return report_invalid(prog, exc)
        return serve(settings)

    parser.set_defaults(func=run)


def report_invalid(prog: str, exc: pydantic.ValidationError) -> int:
    """Prints each validation error as ``prog: field: message``; returns exit code 2."""
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        print(f"{prog}: {where + ': ' if where else ''}{msg}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=_command_name(argv))
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
