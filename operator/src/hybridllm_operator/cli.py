"""`hybridllm crds ...` and `hybridllm operator run`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridllm_operator import crdgen


def _crds_generate(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    if args.check:
        stale = crdgen.drift(out)
        if stale:
            print(
                f"CRDs in {out} are out of date with hybridllm_common.crd: {', '.join(stale)}.\n"
                "Run `hybridllm crds generate` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"CRDs in {out} match the models")
        return 0
    for path in crdgen.write(out):
        print(f"wrote {path}")
    return 0


def register_crds(subparsers: Any) -> None:
    parser = subparsers.add_parser("crds", help="generate the CustomResourceDefinitions")
    sub = parser.add_subparsers(dest="crds_command", required=True, metavar="ACTION")
    generate = sub.add_parser("generate", help="write crds/*.yaml from the pydantic models")
    generate.add_argument("--output-dir", default="crds", help="directory to write (default: crds)")
    generate.add_argument(
        "--check", action="store_true", help="fail if the files differ instead of writing"
    )
    generate.set_defaults(func=_crds_generate)


def watched_namespaces(flag: str | None) -> list[str]:
    """``--namespace``, else ``HYBRIDLLM_OPERATOR_NAMESPACE``; empty: every namespace."""
    from hybridllm_operator.settings import OperatorSettings

    namespace = flag or OperatorSettings().namespace
    return [namespace] if namespace else []


EXIT_UNSERVED = 3  # the watchdog stopped the operator: restart it


def _run(args: argparse.Namespace) -> int:
    import kopf

    from hybridllm_operator import handlers  # registers the handlers

    namespaces = watched_namespaces(args.namespace)
    # An asyncio.Event (bound to kopf's loop when first awaited): kopf would wait for a
    # threading.Event in a thread that keeps the process alive after a stop by signal.
    stop = asyncio.Event()
    memo = kopf.Memo(namespaces=namespaces, stop=stop, stopped_by_watchdog=False)
    kopf.run(
        standalone=True,
        namespaces=namespaces,
        clusterwide=not namespaces,
        liveness_endpoint=args.liveness,
        registry=kopf.get_default_registry(),
        memo=memo,
        stop_flag=stop,
    )
    del handlers
    return EXIT_UNSERVED if memo.stopped_by_watchdog else 0


def register_operator(subparsers: Any) -> None:
    parser = subparsers.add_parser("operator", help="run the Kubernetes operator")
    sub = parser.add_subparsers(dest="operator_command", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="reconcile LLMServices in the current kubeconfig's cluster")
    run.add_argument(
        "--namespace",
        help="watch only this namespace (default: HYBRIDLLM_OPERATOR_NAMESPACE, else all)",
    )
    run.add_argument(
        "--liveness",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    run.set_defaults(func=_run)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridllm-operator")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_operator(subparsers)
    args = parser.parse_args(["operator", *(argv or ["run"])])
    return int(args.func(args))
