"""``hybridllm-cloud serve`` (also ``hybridllm cloud serve``): flags generated from ServeSettings.

A flag left out falls back to ``HYBRIDLLM_CLOUD_<NAME>`` and then to the default, which
is pydantic-settings' precedence (init arguments over environment over defaults).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from hybridllm_cloud import config as config_mod
from hybridllm_common import cli as common_cli

log = logging.getLogger(__name__)


def settings_from_args(args: argparse.Namespace) -> config_mod.ServeSettings:
    return common_cli.settings_from_args(args, config_mod.ServeSettings)


def _serve(settings: config_mod.ServeSettings) -> int:
    from hybridllm_cloud.server import app as app_mod
    from hybridllm_common import http_errors

    if settings.torch_threads is not None:
        import torch

        torch.set_num_threads(settings.torch_threads)
    app = app_mod.create_app(settings)
    http_errors.run_server(app, settings.host, settings.port)
    return 0


def _add_serve(subparsers: Any) -> None:
    common_cli.add_serve(
        subparsers, config_mod.ServeSettings, "HYBRIDLLM_CLOUD_", "hybridllm-cloud serve", _serve
    )


def register(subparsers: Any) -> None:
    """Entry point of ``hybridllm cloud ...``."""
    common_cli.add_group(subparsers, "cloud", _add_serve)


def main(argv: Sequence[str] | None = None) -> int:
    return common_cli.run_standalone("hybridllm-cloud", __doc__, _add_serve, argv)


if __name__ == "__main__":
    sys.exit(main())
