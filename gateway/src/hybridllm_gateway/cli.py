"""``hybridllm-gateway`` (also ``hybridllm gateway``): serve, train-classifier, hash-key.

``serve --config /etc/hybridllm/routing.json --port 8000 [--api-keys-file PATH]`` is the
command line the operator renders; the other flags have defaults that suit a pod.
``--workers N`` starts N processes that share the port through ``SO_REUSEPORT`` (the
kernel spreads connections): state is per process, as it is per gateway replica.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_gateway import config as config_mod

log = logging.getLogger(__name__)


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in config_mod.GatewaySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = field.default
        conv: Any = type(default) if isinstance(default, int | float) else str
        if name in (
            "config", "api_keys_file", "filter_config", "classifier", "tls_cert_file",
            "tls_key_file",
        ):  # fmt: skip
            conv = Path
        parser.add_argument(
            flag,
            type=conv,
            required=name == "config",
            default=None,
            help=field.description
            or (f"default {default}" if name != "config" else "routing.json"),
        )


def settings_from_args(args: argparse.Namespace) -> config_mod.GatewaySettings:
    settings: config_mod.GatewaySettings = common_cli.settings_from_args(
        args, config_mod.GatewaySettings
    )
    return settings


def run_worker(settings: config_mod.GatewaySettings, reuse_port: bool) -> None:
    from aiohttp import web

    from hybridllm_gateway import app as app_mod

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        log.warning("uvloop not installed; running on the default asyncio loop (slower)")
    app = app_mod.create_app(settings)
    tls = None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        ssl_context=tls,
        reuse_port=reuse_port,
        access_log=None,
        handler_cancellation=True,
        backlog=4096,
        print=None,
        # SIGTERM (a pod leaving): stop accepting, let the answers in flight finish
        shutdown_timeout=settings.request_timeout_s,
    )


def _serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    log.info("gateway on %s:%d, %d worker(s)", settings.host, settings.port, settings.workers)
    if settings.workers == 1:
        run_worker(settings, reuse_port=False)
        return 0
    procs = [
        multiprocessing.Process(target=run_worker, args=(settings, True), daemon=True)
        for _ in range(settings.workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


def _train(args: argparse.Namespace) -> int:
    from hybridllm_gateway import classifier

    model, report = classifier.train(args.labels, seed=args.seed)
    args.out.write_text(json.dumps(model.to_json(), indent=2) + "\n")
    print(json.dumps({"out": str(args.out), **report}, indent=2))
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    from hybridllm_gateway import safety

    key = args.key if args.key else sys.stdin.readline().strip()
    print(f"{args.name}:{safety.hash_key(key)}")
    return 0


def _add_commands(sub: Any) -> None:
    from hybridllm_gateway import classifier

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible gateway")
    _serve_flags(serve)
    serve.set_defaults(func=_serve)

    train = sub.add_parser("train-classifier", help="fit the edge/cloud classifier")
    train.add_argument("--labels", type=Path, default=classifier.DEFAULT_LABELS)
    train.add_argument("--out", type=Path, default=classifier.DEFAULT_MODEL)
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=_train)

    hk = sub.add_parser("hash-key", help="print the keys-file line for an API key")
    hk.add_argument("name")
    hk.add_argument("--key", help="the key (read from stdin when absent)")
    hk.set_defaults(func=_hash_key)


def register(subparsers: Any) -> None:
    """Entry point of ``hybridllm gateway ...``."""
    gw = subparsers.add_parser("gateway", help=common_cli.summary("gateway"))
    _add_commands(gw.add_subparsers(dest="gateway_command", metavar="COMMAND", required=True))


def main(argv: Sequence[str] | None = None) -> int:
    code: int = common_cli.run_standalone("hybridllm-gateway", __doc__, _add_commands, argv)
    return code


if __name__ == "__main__":
    sys.exit(main())
