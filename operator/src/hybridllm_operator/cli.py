"""`hybridllm crds ...` and `hybridllm operator run`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridllm_common import cli as common_cli
from hybridllm_operator import crdgen

# Where the generator writes: the repository's crds/ (kubectl apply) and the Helm chart's
# copy, which its templates/crds.yaml installs and upgrades. Both from the same models.
CRD_DIRS = ("crds", "charts/hybridllm/files/crds")


def _crds_generate(args: argparse.Namespace) -> int:
    outs = [Path(d) for d in (args.output_dir or CRD_DIRS)]
    if args.check:
        failed = False
        for out in outs:
            stale = crdgen.drift(out)
            if stale:
                print(
                    f"CRDs in {out} are out of date with hybridllm_common.crd: "
                    f"{', '.join(stale)}.\nRun `hybridllm crds generate` and commit the result.",
                    file=sys.stderr,
                )
                failed = True
            else:
                print(f"CRDs in {out} match the models")
        return 1 if failed else 0
    for out in outs:
        for path in crdgen.write(out):
            print(f"wrote {path}")
    return 0


def register_crds(subparsers: Any) -> None:
    parser = subparsers.add_parser("crds", help=common_cli.summary("crds"))
    sub = parser.add_subparsers(dest="crds_command", required=True, metavar="ACTION")
    generate = sub.add_parser("generate", help="write crds/*.yaml from the pydantic models")
    generate.add_argument(
        "--output-dir",
        action="append",
        help=f"directory to write, repeatable (default: {' and '.join(CRD_DIRS)})",
    )
    generate.add_argument(
        "--check", action="store_true", help="fail if the files differ instead of writing"
    )
    generate.set_defaults(func=_crds_generate)


def _chart_docs(args: argparse.Namespace) -> int:
    from hybridllm_operator import chartdocs

    chart = Path(args.chart)
    try:
        current = chartdocs.update(chart, args.check)
    except chartdocs.DocsError as exc:
        print(f"hybridllm chart docs: {exc}", file=sys.stderr)
        return 1
    if current:
        print(f"{chart / 'README.md'}: the values table matches values.yaml")
        return 0
    if args.check:
        print(
            f"{chart / 'README.md'}: the values table is out of date with values.yaml.\n"
            "Run `hybridllm chart docs` and commit the result.",
            file=sys.stderr,
        )
        return 1
    print(f"wrote the values table of {chart / 'README.md'}")
    return 0


def register_chart(subparsers: Any) -> None:
    parser = subparsers.add_parser("chart", help=common_cli.summary("chart"))
    sub = parser.add_subparsers(dest="chart_command", required=True, metavar="ACTION")
    docs = sub.add_parser("docs", help="write the README's values table from values.yaml")
    docs.add_argument("--chart", default="charts/hybridllm", help="the chart's folder")
    docs.add_argument(
        "--check", action="store_true", help="fail if the table differs instead of writing"
    )
    docs.set_defaults(func=_chart_docs)


def watched_namespaces(flag: str | None) -> list[str]:
    """``--namespace``, else ``HYBRIDLLM_OPERATOR_NAMESPACE`` (comma-separated); empty: every
    namespace."""
    from hybridllm_operator.settings import OperatorSettings

    value = flag or OperatorSettings().namespace or ""
    return [ns.strip() for ns in value.split(",") if ns.strip()]


EXIT_UNSERVED = 3  # the watchdog stopped the operator: restart it
EXIT_LEADERSHIP_LOST = 4  # the Lease was lost: restart, as a standby


class _StandbyHealth:
    """Answers the liveness endpoint while a standby waits for the Lease (kopf serves it
    once this replica leads): a standby is alive, and must not be restarted for waiting."""

    def __init__(self, endpoint: str | None) -> None:
        self.server: Any = None
        if not endpoint:
            return
        import http.server
        import threading
        import urllib.parse

        url = urllib.parse.urlsplit(endpoint)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = b'{"leader": false, "state": "standby"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(
            (url.hostname or "0.0.0.0", url.port or 80), Handler
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _elector() -> Any:
    import kubernetes

    from hybridllm_operator import kubeconfig, leader
    from hybridllm_operator.settings import OperatorSettings

    settings = OperatorSettings()
    if not settings.leader_election:
        return None
    kubeconfig.load(in_cluster_first=True)
    timing = leader.Timing(
        lease_duration=settings.lease_duration_seconds,
        renew_deadline=settings.renew_deadline_seconds,
        retry_period=settings.retry_period_seconds,
    )
    return leader.LeaderElector(
        kubernetes.client.CoordinationV1Api(),
        settings.lease_namespace or leader.default_namespace(),
        settings.lease_name,
        leader.default_identity(),
        timing,
    )


def _run(args: argparse.Namespace) -> int:
    import kopf

    from hybridllm_operator.observability import metrics, page
    from hybridllm_operator.settings import OperatorSettings

    namespaces = watched_namespaces(args.namespace)
    # An asyncio.Event (bound to kopf's loop when first awaited): kopf would wait for a
    # threading.Event in a thread that keeps the process alive after a stop by signal.
    stop = asyncio.Event()
    memo = kopf.Memo(namespaces=namespaces, stop=stop, stopped_by_watchdog=False, loop=None)
    # Served from the start, standby included (it exports leader 0 and no service), so
    # a scrape never finds a replica down for being a standby.
    exported = metrics.OperatorMetrics(lambda: metrics.operator_views(memo))
    settings = OperatorSettings()
    address = args.metrics or settings.metrics_address
    try:
        stop_metrics = (
            page.serve(
                exported, address, settings.prometheus_url, settings.prometheus_rate_window_seconds
            )
            if address
            else None
        )
    except (ValueError, OSError) as exc:
        print(f"hybridllm operator: cannot serve metrics on {address}: {exc}", file=sys.stderr)
        return 2
    try:
        return _lead(args, namespaces, memo, stop, exported)
    finally:
        if stop_metrics is not None:
            stop_metrics()


def _lead(
    args: argparse.Namespace,
    namespaces: list[str],
    memo: Any,
    stop: asyncio.Event,
    exported: Any,
) -> int:
    import os
    import signal
    import threading

    import kopf

    from hybridllm_operator import handlers  # registers the handlers

    elector = _elector()
    lost = threading.Event()
    if elector is not None:
        exported.leader_is = lambda: (
            f"pod {elector.holder} in namespace {elector.namespace}" if elector.holder else None
        )
        # Wait for the Lease before kopf starts: a standby watches and writes nothing.
        # SIGTERM/SIGINT while waiting end the wait (kopf installs its own handlers later).
        waiting = threading.Event()
        previous = {
            sig: signal.signal(sig, lambda *_: waiting.set())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        health = _StandbyHealth(args.liveness)
        try:
            if not elector.acquire(waiting):
                return 0
        finally:
            health.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    exported.lead(True)
    renewing = threading.Event()

    def step_down() -> None:
        """Stop reconciling now; exit hard if kopf has not stopped before the Lease can
        pass to a standby (lease duration less renew deadline from now)."""
        lost.set()
        if memo.loop is not None:
            memo.loop.call_soon_threadsafe(stop.set)
        grace = elector.timing.lease_duration - elector.timing.renew_deadline
        timer = threading.Timer(max(0.5, grace * 0.8), os._exit, (EXIT_LEADERSHIP_LOST,))
        timer.daemon = True
        timer.start()

    if elector is not None:
        threading.Thread(
            target=elector.run_renewals, args=(renewing, step_down), name="lease", daemon=True
        ).start()
    try:
        kopf.run(
            standalone=True,
            namespaces=namespaces,
            clusterwide=not namespaces,
            liveness_endpoint=args.liveness,
            registry=kopf.get_default_registry(),
            memo=memo,
            stop_flag=stop,
        )
    finally:
        exported.lead(False)
        renewing.set()
        if elector is not None and not lost.is_set():
            elector.release()
    del handlers
    if lost.is_set():
        return EXIT_LEADERSHIP_LOST
    return EXIT_UNSERVED if memo.stopped_by_watchdog else 0


def register_operator(subparsers: Any) -> None:
    parser = subparsers.add_parser("operator", help=common_cli.summary("operator"))
    sub = parser.add_subparsers(dest="operator_command", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="reconcile LLMServices in the current kubeconfig's cluster")
    run.add_argument(
        "--namespace",
        help="watch only these namespaces, comma-separated (default: "
        "HYBRIDLLM_OPERATOR_NAMESPACE, else all)",
    )
    run.add_argument(
        "--liveness",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    run.add_argument(
        "--metrics",
        default=None,
        metavar="HOST:PORT",
        help="serve the control plane's Prometheus metrics on /metrics there, and the "
        "dashboard page on / (its data from HYBRIDLLM_OPERATOR_PROMETHEUS_URL), e.g. "
        "0.0.0.0:8081 (default: HYBRIDLLM_OPERATOR_METRICS_ADDRESS, else not served)",
    )
    run.set_defaults(func=_run)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridllm-operator")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register_operator(subparsers)
    args = parser.parse_args(["operator", *(argv or ["run"])])
    return int(args.func(args))
