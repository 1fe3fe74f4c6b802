"""``hybridllm-cloud serve`` (also ``hybridllm cloud serve``): flags generated from ServeSettings.

A flag left out falls back to ``HYBRIDLLM_CLOUD_<NAME>`` and then to the default, which
is pydantic-settings' precedence (init arguments over environment over defaults).
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

import pydantic

from hybridllm_cloud import config as config_mod
from hybridllm_common import cli as common_cli

log = logging.getLogger(__name__)


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in config_mod.ServeSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        base = args[0] if isinstance(ann, types.UnionType) and args else ann
        help_text = (
            f"{field.description} (env HYBRIDLLM_CLOUD_{name.upper()}, default {field.default})"
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


def settings_from_args(args: argparse.Namespace) -> config_mod.ServeSettings:
    given = {
        k: v
        for k, v in vars(args).items()
        if k in config_mod.ServeSettings.model_fields and v is not None
    }
    return config_mod.ServeSettings(**given)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridllm_cloud.server import app as app_mod

    try:
        settings = settings_from_args(args)
    except pydantic.ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            print(f"hybridllm-cloud serve: {where + ': ' if where else ''}{msg}", file=sys.stderr)
        return 2
    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    app = app_mod.create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info")
    return 0


def _add_serve(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    _add_setting_flags(serve)
    serve.set_defaults(func=_serve)


def register(subparsers: Any) -> None:
    """Entry point of ``hybridllm cloud ...``."""
    cloud = subparsers.add_parser("cloud", help="cloud runtime (our paged-KV engine)")
    _add_serve(cloud.add_subparsers(dest="cloud_command", metavar="COMMAND", required=True))


def main(argv: Sequence[str] | None = None) -> int:
    return common_cli.run_standalone("hybridllm-cloud", __doc__, _add_serve, argv)


if __name__ == "__main__":
    sys.exit(main())
