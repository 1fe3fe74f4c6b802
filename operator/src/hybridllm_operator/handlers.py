"""The operator's kopf wiring: what it sets up at start-up and tears down at exit. The
handlers of each resource kind live with the kind, and importing them registers them with
kopf: ``llmservice/handlers.py`` (one reconciler daemon per LLMService, woken by events,
and one ticker for every LLMService's autoscaler and rollout) and ``edgefleet/handlers.py``
(the EdgeDevices and EdgeFleets that the LLMServices of their namespace serve from).
``kopf run -m hybridllm_operator.handlers`` (what `hybridllm operator run` does) loads them.

State lives in kopf's memo: the operator-wide memo (filled here at start-up) holds the API
clients, the images, the executor that runs the blocking reconciles, and each running
LLMService's `ServiceState` by ``(namespace, name)`` (llmservice/jobs.py: its waker,
autoscaler, rollout controller and jobs, made when its daemon starts and dropped when it
ends); each handler gets a shallow copy of the memo, so all see the same ones. The guards
around kopf's watches (waiting for discovery at start-up, the watchdog) are in watchdog.py.
kopf keeps its own bookkeeping in annotations, not in ``status``, because the CRD's status
schema is structural and would prune anything kopf wrote there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import kopf

from hybridllm_common import crd
from hybridllm_operator import kubeconfig
from hybridllm_operator.edgefleet import handlers as edgefleet_handlers  # registers them
from hybridllm_operator.llmservice import demand, reconcile
from hybridllm_operator.llmservice import handlers as llmservice_handlers  # registers them
from hybridllm_operator.llmservice.jobs import Ticker
from hybridllm_operator.settings import OperatorSettings
from hybridllm_operator.watchdog import Heard, wait_for_discovery, watchdog

Logger = logging.Logger | logging.LoggerAdapter[Any]
__all__ = ["configure", "edgefleet_handlers", "llmservice_handlers", "shutdown", "start_watchdog"]


class _QuietEventHandlers(logging.Filter):
    """Drop kopf's per-event success line of the wake-up handlers: one per child event."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Handler '") and "_event' succeeded" in message) and (
            "Handler 'child_changed' succeeded" not in message
            and "Handler 'pod_changed' succeeded" not in message
        )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Logger, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the structural status schema
    # would prune kopf's status fields and make it re-run handlers forever.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration"
    )
    # Kubernetes Events only for warnings and errors: successful reconciles are frequent.
    settings.posting.level = logging.WARNING
    # Of several replicas one reconciles: `hybridllm operator run` took the Lease before kopf
    # started (leader.py explains why not kopf's peering). No peering objects are needed.
    settings.peering.standalone = True
    # The CRDs are resolved once, after `wait_for_discovery` below; no watch of every CRD
    # and namespace in the cluster (and no cluster-wide RBAC for it in namespaced mode).
    # A CRD removed and re-created is caught by the watchdog, which restarts the operator.
    settings.scanning.disabled = True
    # kopf's per-object event workers linger this long when idle, and a stopping operator
    # waits for them before it returns (and releases its Lease): 5 s by default. A worker
    # is cheap to start again on the next event.
    settings.queueing.idle_timeout = 1.0
    # A transient API error retries soon rather than after kopf's default minute.
    settings.watching.reconnect_backoff = 1.0
    kubeconfig.load(in_cluster_first=True)
    operator_settings = OperatorSettings()
    memo.cluster = reconcile.Cluster.connect()
    # kopf resolves the resources it serves once, right after this handler: an API server
    # still installing its paths (just restarted, or being upgraded) would leave them
    # unresolved, and the operator would serve nothing, for good. Wait until it has them.
    wait_for_discovery(memo.cluster, logger)
    memo.images = operator_settings.images()
    memo.resync_seconds = operator_settings.resync_seconds
    memo.prometheus_url = operator_settings.prometheus_url
    # every LLMService's autoscaler reads its demand from the same queries (demand/prometheus.py)
    memo.prometheus_batch = (
        demand.PrometheusBatch(memo.prometheus_url) if memo.prometheus_url else None
    )
    memo.rate_window_s = operator_settings.prometheus_rate_window_seconds
    memo.forecast_bin_s = operator_settings.forecast_bin_seconds
    memo.forecast_season_s = operator_settings.forecast_season_seconds
    memo.forecast_model = operator_settings.forecast_model
    memo.services = {}  # (namespace, name) -> its ServiceState while its daemon runs
    memo.devices = {}  # (namespace, EdgeDevice name) -> its fleet, labels, URL, revision
    memo.fleets = {}  # (namespace, EdgeFleet name) -> its status (the fleet server's)
    # Reconciles are short, blocking API calls: a bounded pool of threads runs them.
    memo.executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=operator_settings.max_workers, thread_name_prefix="reconcile"
    )
    # Handlers get a shallow copy of the memo: what they change for all to see lives in
    # objects the copies share (the dicts above, this counter), never in a memo attribute.
    memo.heard = Heard()
    # The autoscalers' reads (HTTP to Prometheus or the gateways) and forecasts run on
    # threads of their own: a slow metrics endpoint never delays a reconcile.
    memo.scale_executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=operator_settings.max_workers, thread_name_prefix="autoscale"
    )
    logging.getLogger("kopf.objects").addFilter(_QuietEventHandlers())
    logger.info("hybridllm operator configured: images %s", memo.images)


@kopf.on.startup()
async def start_watchdog(memo: kopf.Memo, logger: Logger, **_: Any) -> None:
    loop = asyncio.get_running_loop()
    memo.loop = loop  # for `operator run`'s step-down from its thread
    memo.watchdog = loop.create_task(watchdog(memo, logger))
    # Started by the first reconciler (`Ticker.start`): a task takes the context of the one
    # that makes it, and kopf.event (the jobs post Events) needs the context kopf gives its
    # handlers, which its start-up activities do not have yet.
    memo.ticker = Ticker()


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("watchdog") is not None:
        memo.watchdog.cancel()
    if memo.get("ticker") is not None:
        memo.ticker.stop()
    memo.executor.shutdown(wait=False, cancel_futures=True)
    memo.scale_executor.shutdown(wait=False, cancel_futures=True)
