"""``hybridllm-edge serve`` (also ``hybridllm edge serve``): flags generated from EdgeSettings;
``hybridllm-edge agent``: the edge device agent (``hybridllm_edge.agent``).

A flag left out falls back to ``HYBRIDLLM_EDGE_<NAME>`` and then to the default
(pydantic-settings' precedence). Booleans get ``--x/--no-x`` (``--no-cache``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_edge import config

log = logging.getLogger(__name__)


def settings_from_args(args: argparse.Namespace) -> config.EdgeSettings:
    return common_cli.settings_from_args(args, config.EdgeSettings)


def _serve(settings: config.EdgeSettings) -> int:
    from hybridllm_common import http_errors
    from hybridllm_edge.server import app as app_mod

    try:
        settings.store_target()
    except ValueError as exc:
        print(f"hybridllm-edge: {exc}", file=sys.stderr)
        return 2
    app = app_mod.create_app(settings)
    http_errors.run_server(app, settings.host, settings.port, settings.ssl_certfile,
                           settings.ssl_keyfile)  # fmt: skip
    return 0


def _add_serve(subparsers: Any) -> None:
    common_cli.add_serve(
        subparsers, config.EdgeSettings, "HYBRIDLLM_EDGE_", "hybridllm-edge serve", _serve
    )


def _add_commands(subparsers: Any) -> None:
    from hybridllm_edge import agent

    _add_serve(subparsers)
    agent.add_agent(subparsers)


def register(subparsers: Any) -> None:
    """Entry point of ``hybridllm edge ...``."""
    common_cli.add_group(subparsers, "edge", _add_commands)


def main(argv: Sequence[str] | None = None) -> int:
    return common_cli.run_standalone("hybridllm-edge", __doc__, _add_commands, argv)


if __name__ == "__main__":
    sys.exit(main())
