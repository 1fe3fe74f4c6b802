"""``hybridllm-edge serve`` (also ``hybridllm edge serve``): flags generated from EdgeSettings.

A flag left out falls back to ``HYBRIDLLM_EDGE_<NAME>`` and then to the default
(pydantic-settings' precedence). Booleans get ``--x/--no-x`` (``--no-cache``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_edge import config

log = logging.getLogger(__name__)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in config.EdgeSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        union = typing.get_origin(ann) in (typing.Union, types.UnionType)
        base = args[0] if union and args else ann
        help_text = (
            f"{field.description} (env HYBRIDLLM_EDGE_{name.upper()}, default {field.default})"
        )
        if base is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(base) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(base), default=None, help=help_text)
        else:
            conv: Any = base if base in (int, float) else str
            parser.add_argument(flag, type=conv, default=None, help=help_text)


def settings_from_args(args: argparse.Namespace) -> config.EdgeSettings:
    given = {
        k: v
        for k, v in vars(args).items()
        if k in config.EdgeSettings.model_fields and v is not None
    }
    return config.EdgeSettings(**given)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridllm_edge.server import app as app_mod

    settings = settings_from_args(args)
    try:
        settings.store_target()
    except ValueError as exc:
        print(f"hybridllm-edge: {exc}", file=sys.stderr)
        return 2
    app = app_mod.create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    return 0


def _add_serve(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    _add_setting_flags(serve)
    serve.set_defaults(func=_serve)


def register(subparsers: Any) -> None:
    """Entry point of ``hybridllm edge ...``."""
    edge = subparsers.add_parser("edge", help="edge runtime (llama.cpp / onnxruntime)")
    _add_serve(edge.add_subparsers(dest="edge_command", metavar="COMMAND", required=True))


def main(argv: Sequence[str] | None = None) -> int:
    return common_cli.run_standalone("hybridllm-edge", __doc__, _add_serve, argv)


if __name__ == "__main__":
    sys.exit(main())
