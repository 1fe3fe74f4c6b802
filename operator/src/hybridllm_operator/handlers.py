"""kopf handlers: one reconciler daemon per LLMService, woken by events; one ticker for
every LLMService's autoscaler and rollout.

kopf runs a daemon per LLMService for as long as the object exists (spawned when it is
created or when the operator starts, stopped when it is deleted). The daemon is the only
place that reconciles its LLMService, so one LLMService is never reconciled twice at once
(a child's status change can no longer race the parent's own reconcile or its status
patch). Everything else only wakes it:

- an event of the LLMService whose ``metadata.generation`` differs from the last one
  reconciled (a spec change; the daemon's own status patches do not wake it);
- any event of an owned child (a Deployment's status, a hand edit, a deletion): found by
  its controller ``ownerReference``, without asking the API server for the parent.

A burst of events coalesces into one reconcile. A reconcile that fails on the API server
(409, 429, 5xx, a lost connection) is retried by the daemon with back-off (1 s doubling
to 60 s) until it succeeds; a spec that can never work is reported as ``Degraded`` and
waits for the next spec change; and every ``resync_seconds`` (default an hour) the
daemon reconciles anyway, as a safety net for an event lost while the watch reconnected.

The periodic work of each LLMService (its autoscaler every
``spec.autoscaling.intervalSeconds``, its rollout every few seconds) are `Job` objects
that one `Ticker` task runs when they are due, for as long as the LLMService's reconciler
runs. Before, each was a kopf daemon of its own: three tasks and their timers per
LLMService, which at a thousand services kept an idle operator busy.

State lives in kopf's memo: the operator-wide memo (filled at start-up) holds the API
clients, the images, the executor that runs the blocking reconciles and the wakers by
``(namespace, name)``; each handler gets a shallow copy of it, so all see the same ones.
kopf keeps its own bookkeeping in annotations, not in ``status``, because the CRD's status
schema is structural and would prune anything kopf wrote there. Daemons need kopf's
finalizer on each LLMService, so that deleting one stops its daemon first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import heapq
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import kopf
import urllib3
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_forecaster.autoscaler import DECIDING
from hybridllm_operator import (
    analysis,
    autoscaling,
    builders,
    demand,
    kubeconfig,
    reconcile,
    rollout,
)
from hybridllm_operator.settings import OperatorSettings

LLMSERVICES = (crd.GROUP, crd.VERSION, "llmservices")
Logger = logging.Logger | logging.LoggerAdapter[Any]
OWNED = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
TRANSIENT_STATUSES = (409, 429, 500, 502, 503, 504)


class _QuietEventHandlers(logging.Filter):
    """Drop kopf's per-event success line of the wake-up handlers: one per child event."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Handler '") and "_event' succeeded" in message) and (
            "Handler 'child_changed' succeeded" not in message
            and "Handler 'pod_changed' succeeded" not in message
        )


@dataclasses.dataclass
class Waker:
    """How events reach one LLMService's daemon."""

    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    generation: int | None = None  # the last generation reconciled (or found invalid)
    reconciles: int = 0
    applied: reconcile.Applied = dataclasses.field(default_factory=reconcile.Applied)


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
    # every LLMService's autoscaler reads its demand from the same queries (demand.py)
    memo.prometheus_batch = (
        demand.PrometheusBatch(memo.prometheus_url) if memo.prometheus_url else None
    )
    memo.rate_window_s = operator_settings.prometheus_rate_window_seconds
    memo.forecast_bin_s = operator_settings.forecast_bin_seconds
    memo.forecast_season_s = operator_settings.forecast_season_seconds
    memo.forecast_model = operator_settings.forecast_model
    memo.scalers = {}  # (namespace, name) -> autoscaling.ServiceAutoscaler
    memo.gateways = {}  # (namespace, name) -> {pod name: metrics URL} of Ready gateway pods
    memo.rollouts = {}  # (namespace, name) -> rollout.Controller
    memo.devices = {}  # (namespace, EdgeDevice name) -> its fleet, labels, URL, revision
    memo.fleets = {}  # (namespace, EdgeFleet name) -> its status (the fleet server's)
    # Reconciles are short, blocking API calls: a bounded pool of threads runs them.
    memo.executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=operator_settings.max_workers, thread_name_prefix="reconcile"
    )
    memo.wakers = {}
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


# What the operator watches, as discovery must list it: (group version path, resource).
SERVED = (
    ("/api/v1", "configmaps"),
    ("/api/v1", "services"),
    ("/api/v1", "pods"),
    ("/apis/apps/v1", "deployments"),
    ("/apis/policy/v1", "poddisruptionbudgets"),
    ("/apis/networking.k8s.io/v1", "networkpolicies"),
    (f"/apis/{crd.API_VERSION}", "llmservices"),
)


def missing_resources(cluster: reconcile.Cluster) -> list[str]:
    """The served resources the API server's discovery does not list (yet)."""
    missing = []
    for path, resource in SERVED:
        try:
            listing = cluster.dyn.request("GET", path, serialize=False)
            names = {r.get("name") for r in json.loads(listing.data).get("resources", [])}
        except (k8s_errors.ApiException, OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            missing.append(
                f"{path}/{resource} ({getattr(exc, 'status', None) or type(exc).__name__})"
            )
            continue
        if resource not in names:
            missing.append(f"{path}/{resource}")
    return missing


def wait_for_discovery(cluster: reconcile.Cluster, logger: Logger) -> None:
    delay, waited, said = 0.2, 0.0, 0.0
    while missing := missing_resources(cluster):
        if waited - said >= 10 or not said:
            logger.warning("waiting for the API server to serve %s", ", ".join(missing))
            said = waited or 1e-9
        time.sleep(delay)
        waited += delay
        delay = min(delay * 2, 5.0)


WATCHDOG_PERIOD_S = 15.0
WATCHDOG_GRACE_S = 30.0


# Only the objects' metadata, as the API server's metadata-only listing gives it: the
# watchdog reads names and times, and a full listing of every LLMService each period
# (parsed into the dynamic client's objects) was most of an idle operator's CPU.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def llmservice_metadata(cluster: reconcile.Cluster, namespace: str | None) -> list[dict[str, Any]]:
    """The metadata of every LLMService (in ``namespace``; None: all), from the API
    server's watch cache (``resourceVersion=0``: no read from etcd)."""
    where = f"/namespaces/{namespace}" if namespace else ""
    response = cluster.dyn.request(
        "GET",
        f"/apis/{crd.API_VERSION}{where}/llmservices",
        serialize=False,
        header_params={"Accept": f"{METADATA_LIST},application/json"},
        query_params=[("resourceVersion", "0")],
    )
    return [item["metadata"] for item in json.loads(response.data)["items"]]


def _unserved(
    cluster: reconcile.Cluster, namespaces: list[str | None], wakers: dict[Any, Any]
) -> list[str]:
    """LLMServices older than the grace period that no daemon of ours reconciles."""
    listed: list[dict[str, Any]] = []
    for ns in [*namespaces] or [None]:
        listed += llmservice_metadata(cluster, ns)
    now = datetime.datetime.now(datetime.UTC)
    out = []
    for meta in listed:
        created = datetime.datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
        if (
            not meta.get("deletionTimestamp")
            and (now - created).total_seconds() > WATCHDOG_GRACE_S
            and (meta["namespace"], meta["name"]) not in wakers
        ):
            out.append(f"{meta['namespace']}/{meta['name']}")
    return out


@dataclasses.dataclass
class Heard:
    """LLMService events the operator's handlers saw (shared by every copy of the memo)."""

    events: int = 0


@dataclasses.dataclass
class WatchdogCount:
    """The watchdog's verdict over its looks. A missing watch serves no LLMService and
    delivers no event; some served, or events still arriving, is kopf working through a
    burst (a thousand LLMServices applied at once start their daemons over minutes on a
    busy operator), not a missing watch."""

    events: int = 0  # LLMService events heard by the last look
    misses: int = 0

    def look(self, unserved: list[str], events: int, serving: bool) -> bool:
        """Whether to stop: the second look in a row that finds LLMServices no daemon
        serves, while none is served and no LLMService event arrived since the last."""
        progressing = events != self.events
        self.events = events
        self.misses = self.misses + 1 if unserved and not progressing and not serving else 0
        return self.misses >= 2


async def watchdog(memo: kopf.Memo, logger: Logger) -> None:
    """Stop the operator when LLMServices exist that no daemon serves, while it serves
    none and hears of none, twice in a row: kopf resolved its resources while the API
    server was not serving them all, and it never resolves them again. A restart (the
    Deployment's) does. Embedded without a stop flag (kopf's test runner), it only logs.
    It lists LLMServices only while it serves none."""
    loop = asyncio.get_running_loop()
    namespaces: list[str | None] = list(memo.get("namespaces") or [])
    count = WatchdogCount(events=memo.heard.events)
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        serving = any(not namespaces or ns in namespaces for ns, _ in list(memo.wakers))
        unserved: list[str] = []
        # Serving any LLMService proves the watch: no listing then (at a thousand services
        # the listing of their metadata every period was most of an idle operator's work).
        if not serving:
            try:
                unserved = await loop.run_in_executor(
                    memo.executor, _unserved, memo.cluster, namespaces, memo.wakers
                )
            except (k8s_errors.ApiException, OSError, urllib3.exceptions.HTTPError) as exc:
                logger.info("watchdog could not list LLMServices: %s", exc)
                continue
        if count.look(unserved, memo.heard.events, serving):
            logger.error(
                "LLMServices %s have no reconciler: the operator is not watching them (the "
                "API server did not list the resource when it started); exiting so that it "
                "restarts and watches again",
                ", ".join(unserved[:5]),
            )
            stop = memo.get("stop")
            if stop is not None:  # `hybridllm operator run`: stop kopf, exit non-zero
                memo.stopped_by_watchdog = True
                stop.set()
                return
            count.misses = 0  # embedded (no stop flag): say it again at the next misses


class Ticker:
    """Runs every LLMService's periodic looks (its autoscaler, its rollout) from one task.

    A look is a `Job`: an async callable that does one pass and returns the seconds until
    its next. The ticker keeps the jobs in a heap by due time and sleeps until the first
    is due, so a thousand idle LLMServices cost one sleeping task, not two thousand. A job
    runs as a task of its own while it works (a slow Prometheus delays only that job),
    and never twice at once: it is due again only after its pass returned. `poke` makes
    a job due now (or, while it runs, right after).
    """

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Job]] = []
        self.count = 0
        self.wake = asyncio.Event()
        self.running: set[asyncio.Task[None]] = set()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the ticker's loop: once, however often it is asked (by every reconciler)."""
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def add(self, job: Job, delay: float = 0.0) -> None:
        """Make ``job`` due in ``delay`` seconds (its earlier due time no longer counts)."""
        loop = asyncio.get_running_loop()
        self.count += 1
        job.entry = self.count
        heapq.heappush(self.heap, (loop.time() + delay, self.count, job))
        self.wake.set()

    def poke(self, job: Job) -> None:
        """Something changed that ``job`` acts on: run it now, not at its next tick."""
        if job.running:
            job.poked = True
        elif not job.stopped:
            self.add(job)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            while self.heap and self.heap[0][0] <= now:
                _, entry, job = heapq.heappop(self.heap)
                if not job.stopped and entry == job.entry and not job.running:
                    job.running = True
                    task = loop.create_task(self._pass(job))
                    self.running.add(task)
                    task.add_done_callback(self.running.discard)
            self.wake.clear()
            timeout = self.heap[0][0] - now if self.heap else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout)

    async def _pass(self, job: Job) -> None:
        try:
            wait = await job()
        except Exception:
            # A bug, not the cluster: say so and look again later (the job must not die).
            job.logger.exception("%s of %s/%s failed", job.what, *job.key)
            wait = RETRY_MAX_S
        finally:
            job.running = False
        if job.poked:
            job.poked, wait = False, 0.0
        if not job.stopped:
            self.add(job, wait)


class Job:
    """One LLMService's periodic look, run by the `Ticker` until ``stopped``."""

    what = "look"

    def __init__(
        self, key: tuple[str, str], body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        self.key, self.body, self.memo, self.logger = key, body, memo, logger
        self.stopped = False
        self.running = False
        self.poked = False
        self.entry = 0  # the ticker's heap entry that counts (older ones are skipped)

    async def __call__(self) -> float:
        raise NotImplementedError


@kopf.on.startup()
async def start_watchdog(memo: kopf.Memo, logger: Logger, **_: Any) -> None:
    loop = asyncio.get_running_loop()
    memo.loop = loop  # for `operator run`'s step-down from its thread
    memo.watchdog = loop.create_task(watchdog(memo, logger))
    # Started by the first reconciler (`Ticker.start`): a task takes the context of the one
    # that makes it, and kopf.event (the jobs post Events) needs the context kopf gives its
    # handlers, which its start-up activities do not have yet.
    memo.ticker = Ticker()
    memo.specs = {}  # (namespace, name) -> (generation, its parsed spec or None: invalid)
    memo.jobs = {}  # (namespace, name) -> [its AutoscalerJob, its RolloutJob]


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    if memo.get("watchdog") is not None:
        memo.watchdog.cancel()
    if memo.get("ticker") is not None:
        memo.ticker.stop()
    memo.executor.shutdown(wait=False, cancel_futures=True)
    memo.scale_executor.shutdown(wait=False, cancel_futures=True)


def _key(meta: Mapping[str, Any]) -> tuple[str, str]:
    return str(meta.get("namespace")), str(meta.get("name"))


async def _sleep_until_woken(waker: Waker, timeout: float | None) -> bool:
    """Whether an event woke it (False: the timeout did)."""
    try:
        await asyncio.wait_for(waker.event.wait(), timeout)
    except TimeoutError:
        return False
    return True


def _scaling(memo: kopf.Memo, key: tuple[str, str], meta: Mapping[str, Any]) -> Any:
    """This LLMService's autoscaler, shared by its reconciler and its autoscaling job,
    made from the state saved in the annotation (what it set before a restart)."""
    scaling = memo.scalers.get(key)
    if scaling is None:
        scaling = autoscaling.ServiceAutoscaler(
            bin_s=memo.forecast_bin_s, model=memo.forecast_model,
            season_s=memo.forecast_season_s,
        )  # fmt: skip
        scaling.restore((meta.get("annotations") or {}).get(autoscaling.STATE_ANNOTATION))
        memo.scalers[key] = scaling
    return scaling


def _rollouts(memo: kopf.Memo, key: tuple[str, str], body: Mapping[str, Any]) -> Any:
    """This LLMService's rollout controller, shared by its reconciler and its rollout job,
    made from ``status.rollout`` (where a restarted operator finds the step it was at)."""
    controller = memo.rollouts.get(key)
    if controller is None:
        controller = rollout.Controller((body.get("status") or {}).get("rollout"))
        memo.rollouts[key] = controller
    return controller


def _post(body: kopf.Body, controller: Any, logger: Logger) -> None:
    for type_, reason, message in controller.take_events():
        kopf.event(body, type=type_, reason=reason, message=message)
        logger.info("rollout: %s: %s", reason, message)


@kopf.daemon(*LLMSERVICES, cancellation_timeout=30.0)
async def reconciler(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, logger: Logger, **_: Any
) -> None:
    """Reconcile this LLMService now, then each time something wakes it, until deleted.
    Its autoscaler and its rollout run as jobs of the operator's one `Ticker` for as long
    as this daemon does."""
    key = _key(meta)
    waker = Waker()
    memo.wakers[key] = waker
    scaling = _scaling(memo, key, meta)
    rollouts = _rollouts(memo, key, body)
    memo.ticker.start()
    jobs = [AutoscalerJob(key, body, memo, logger), RolloutJob(key, body, memo, logger)]
    memo.jobs[key] = jobs
    for job in jobs:
        memo.ticker.add(job)
    loop = asyncio.get_running_loop()
    retry_s = RETRY_FIRST_S
    try:
        while True:
            waker.event.clear()
            snapshot = {k: v for k, v in body.items()}  # the live view, frozen for this pass
            generation = snapshot["metadata"].get("generation")
            rollout_before = rollouts.state
            wait: float | None
            try:
                await loop.run_in_executor(
                    memo.executor,
                    reconcile.reconcile,
                    memo.cluster,
                    snapshot,
                    memo.images,
                    waker.applied,
                    scaling,
                    rollouts,
                    serving_devices(memo, key[0], snapshot.get("spec") or {}),
                )
            except reconcile.InvalidSpec as exc:
                # Degraded, with the field named, is in the status; nothing to retry
                # until the spec changes.
                logger.warning("invalid spec: %s", exc)
                waker.generation, wait, retry_s = generation, None, RETRY_FIRST_S
            except (k8s_errors.ApiException, OSError) as exc:
                status = getattr(exc, "status", None)
                if _namespace_terminating(exc):
                    # Its namespace is going, and this LLMService with it: nothing to
                    # converge (each child event would only be refused again).
                    logger.info("namespace %s is being deleted: no more reconciles", key[0])
                    return
                if isinstance(exc, k8s_errors.ApiException) and status not in TRANSIENT_STATUSES:
                    logger.error("reconcile failed (API server answered %s): %s", status, exc)
                else:
                    logger.info("reconcile interrupted (%s); retrying in %.0f s", exc, retry_s)
                wait, retry_s = retry_s, min(retry_s * 2, RETRY_MAX_S)
            except Exception:
                # A bug, not the cluster: say so with the traceback and keep serving
                # (the daemon must not die, or the service would have no reconciler).
                logger.exception("reconcile failed; retrying in %.0f s", retry_s)
                wait, retry_s = retry_s, min(retry_s * 2, RETRY_MAX_S)
            else:
                waker.generation, wait, retry_s = generation, memo.resync_seconds, RETRY_FIRST_S
                waker.reconciles += 1
            _post(body, rollouts, logger)
            if rollouts.state != rollout_before:  # a rollout started, restarted or ended
                memo.ticker.poke(jobs[1])
            if not await _sleep_until_woken(waker, wait):
                # A quiet resync compares the status with the object as it is, not with
                # what this daemon last wrote: a status edited by hand is written again.
                waker.applied.status = None
    finally:
        for job in jobs:
            job.stopped = True
        if memo.jobs.get(key) is jobs:
            del memo.jobs[key]
        if memo.wakers.get(key) is waker:
            del memo.wakers[key]
        if memo.scalers.get(key) is scaling:  # the object is gone (or the operator stops)
            del memo.scalers[key]
        if memo.rollouts.get(key) is rollouts:
            del memo.rollouts[key]
        memo.gateways.pop(key, None)
        memo.specs.pop(key, None)


def _namespace_terminating(exc: Exception) -> bool:
    """The API server refused a write because the namespace is being deleted."""
    return (
        isinstance(exc, k8s_errors.ApiException)
        and exc.status == 403
        and "NamespaceTerminating" in str(exc.body or "")
    )


def _spec_or_none(memo: kopf.Memo, key: tuple[str, str], body: Mapping[str, Any]) -> Any:
    """The object's spec, or None when it is invalid (the reconciler says why in the
    status). Parsed once per generation: the jobs look every few seconds, the spec
    changes only with ``metadata.generation``."""
    generation = (body.get("metadata") or {}).get("generation")
    cached = memo.specs.get(key)
    if cached is not None and cached[0] == generation and generation is not None:
        return cached[1]
    try:
        spec: crd.LLMServiceSpec | None = reconcile.parse_spec(key[1], dict(body.get("spec") or {}))
    except reconcile.InvalidSpec:
        spec = None
    memo.specs[key] = (generation, spec)
    return spec


PERSIST_EVERY_S = 60.0  # the autoscaler's state is saved at least this often while it runs


def _demand_source(memo: kopf.Memo, key: tuple[str, str]) -> demand.DemandSource:
    if memo.prometheus_url:
        return demand.PrometheusDemand(
            memo.prometheus_url, key[0], key[1], bin_s=memo.forecast_bin_s,
            rate_window_s=memo.rate_window_s, batch=memo.prometheus_batch,
        )  # fmt: skip
    return demand.GatewayScrape(
        lambda: list(memo.gateways.get(key, {}).values()), bin_s=memo.forecast_bin_s
    )


def _visible(scaling: Any) -> Any:
    """What of the autoscaler the status shows: a reconcile is needed when it changes."""
    return (
        autoscaling.summary_key(scaling),
        {c: autoscaling.pool_fields(d) for c, d in scaling.decisions.items()},
    )


def _annotate(
    cluster: reconcile.Cluster, namespace: str, name: str, key: str, value: str | None
) -> None:
    """Set (None: remove) one annotation of the LLMService."""
    cluster.llmservices().patch(
        name=name,
        namespace=namespace,
        body={"metadata": {"annotations": {key: value}}},
        content_type="application/merge-patch+json",
    )


def _step(scaling: Any, source: demand.DemandSource) -> Any:
    now = time.time()
    return scaling.step(now, source.read(now), scaling.observed)


class AutoscalerJob(Job):
    """Size this LLMService's pools every ``spec.autoscaling.intervalSeconds``: read the
    demand, decide, hand the replicas to the reconciler (which writes them and the status),
    post an Event for each change and save the autoscaler's state on the object."""

    what = "autoscaling"

    def __init__(
        self, key: tuple[str, str], body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        super().__init__(key, body, memo, logger)
        self.source: demand.DemandSource | None = None
        self.shown: Any = None
        self.saved_at, self.saved = 0.0, cast(str | None, None)
        self.advised: dict[str, int] = {}  # the last recommendation per pool (advisory mode)

    async def __call__(self) -> float:
        memo, key, body = self.memo, self.key, self.body
        scaling = memo.scalers.get(key)
        spec = _spec_or_none(memo, key, body)
        if spec is None or scaling is None:
            return 15.0
        scaling.configure(spec)
        if scaling.mode in DECIDING and scaling.observed:
            loop = asyncio.get_running_loop()
            self.source = self.source or _demand_source(memo, key)
            changed = await loop.run_in_executor(memo.scale_executor, _step, scaling, self.source)
            if self.stopped:
                return 0.0
            for component, (old, new) in changed.items():
                reason = scaling.decisions[component].reason
                kopf.event(
                    body, type="Normal", reason="Scaled",
                    message=f"{component}: {old} -> {new} replicas ({reason})",
                )  # fmt: skip
                self.logger.info("scaled %s from %d to %d: %s", component, old, new, reason)
            for component, decision in scaling.decisions.items():
                # advisory: an Event each time the recommendation moves
                if scaling.mode == "advisory" and decision.recommended is not None:
                    if self.advised.get(component) not in (None, decision.recommended):
                        kopf.event(
                            body, type="Normal", reason="Recommended",
                            message=f"{component}: {decision.recommended} replicas "
                            f"recommended ({decision.reason})",
                        )  # fmt: skip
                    self.advised[component] = decision.recommended
            waker = cast(Waker | None, memo.wakers.get(key))
            if waker is not None and (changed or _visible(scaling) != self.shown):
                self.shown = _visible(scaling)
                waker.event.set()
            state = json.dumps(scaling.state(), separators=(",", ":"))
            if state != self.saved and (changed or time.time() - self.saved_at >= PERSIST_EVERY_S):
                try:
                    await loop.run_in_executor(
                        memo.executor,
                        _annotate,
                        memo.cluster,
                        key[0],
                        key[1],
                        autoscaling.STATE_ANNOTATION,
                        state,
                    )
                    self.saved, self.saved_at = state, time.time()
                except (k8s_errors.ApiException, OSError) as exc:
                    self.logger.info("autoscaler state not saved (retrying later): %s", exc)
        # The next boundary of the interval on the wall clock: every LLMService of one
        # interval reads at the same moment, so with Prometheus they share one answer.
        interval = float(spec.autoscaling.interval_seconds)
        return interval - time.time() % interval + BOUNDARY_SLACK_S


BOUNDARY_SLACK_S = 0.01  # wake just past the boundary, never just before it


def _windows(memo: kopf.Memo, key: tuple[str, str]) -> analysis.WindowSource:
    if memo.prometheus_url:
        return analysis.PrometheusWindows(memo.prometheus_url, key[0], key[1])
    return analysis.ScrapeWindows(lambda: list(memo.gateways.get(key, {}).values()))


class RolloutJob(Job):
    """Drive this LLMService's rollout: wait for the canary's pools and the gateways,
    analyse each step's window, act on hand commands (the ``hybridllm.io/rollout-action``
    annotation, removed once acted on) and hand each new state to the reconciler, which
    renders the pools and weights and writes ``status.rollout``."""

    what = "rollout"

    def __init__(
        self, key: tuple[str, str], body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        super().__init__(key, body, memo, logger)
        self.source: analysis.WindowSource | None = None
        # what a fleet's devices report, for a step that moves them (through Prometheus,
        # which scrapes the fleet server; without it such a step is judged on the gateways
        # alone)
        self.kpis = (
            analysis.PrometheusDeviceKpis(memo.prometheus_url) if memo.prometheus_url else None
        )

    async def __call__(self) -> float:
        memo, key, body = self.memo, self.key, self.body
        controller = memo.rollouts.get(key)
        spec = _spec_or_none(memo, key, body)
        if spec is None or controller is None or controller.state is None:
            return ROLLOUT_IDLE_S  # the reconcile pokes it when a rollout starts
        loop = asyncio.get_running_loop()
        action = (body.get("metadata", {}).get("annotations") or {}).get(rollout.ACTION_ANNOTATION)
        self.source = self.source or _windows(memo, key)
        try:
            fleet = _fleet(memo, key[0], spec)
            scaling = memo.scalers.get(key)
            profile = (
                scaling.day_profile()
                if scaling is not None and rollout.is_scheduled(controller.state)
                else None
            )
            obs = await loop.run_in_executor(
                memo.scale_executor, rollout.look, controller, spec, self.source, action,
                fleet, self.kpis, profile, scaling.forecast_need if scaling is not None else None,
            )  # fmt: skip
            if self.stopped:
                return 0.0
            before = controller.state
            controller.advance(spec, obs)
            if controller.state != before:
                waker = cast(Waker | None, memo.wakers.get(key))
                if waker is not None:
                    waker.event.set()
            _post(body, controller, self.logger)
            if action:
                await loop.run_in_executor(
                    memo.executor,
                    _annotate,
                    memo.cluster,
                    key[0],
                    key[1],
                    rollout.ACTION_ANNOTATION,
                    None,
                )
        except (k8s_errors.ApiException, OSError) as exc:
            self.logger.info("rollout step interrupted (retrying): %s", exc)
        if controller.state.phase in rollout.ENDED and not action:
            return ROLLOUT_IDLE_S  # nothing to drive: a new revision or a command pokes it
        return float(rollout.tick_seconds(controller.state, spec))


# How often the rollout job of an LLMService with no rollout under way looks anyway (a
# start, a hand command and a spec change poke it at once).
ROLLOUT_IDLE_S = 60.0


@kopf.on.event(crd.GROUP, crd.VERSION, "edgedevices")
async def device_changed(
    type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    """An edge device became ready, moved to another revision or went offline: index it,
    and wake the namespace's LLMServices (those that name its fleet list it)."""
    namespace = str(meta.get("namespace"))
    status = body.get("status") or {}
    serving = status.get("healthy") and status.get("endpoint") and status.get("phase") in (
        crd.DevicePhase.Ready.value, crd.DevicePhase.Updating.value
    )  # fmt: skip
    key = (namespace, str(meta.get("name")))
    before = memo.devices.get(key)
    if type == "DELETED" or not serving or (body.get("spec") or {}).get("revoked"):
        memo.devices.pop(key, None)
    else:
        labels = dict(meta.get("labels") or {})
        fleet = (body.get("spec") or {}).get("fleet")
        memo.devices[key] = (fleet, labels, status["endpoint"], status.get("revision") or "")
    if memo.devices.get(key) != before:
        for (ns, _), waker in list(memo.wakers.items()):
            if ns == namespace:
                waker.event.set()


@kopf.on.event(crd.GROUP, crd.VERSION, "edgefleets")
async def fleet_changed(
    type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any
) -> None:
    """Keep each EdgeFleet's status: a rollout step that moves the devices waits for the
    fleet's rollout of the new revision (its rollout loop looks every few seconds)."""
    key = (str(meta.get("namespace")), str(meta.get("name")))
    if type == "DELETED":
        memo.fleets.pop(key, None)
    else:
        memo.fleets[key] = dict(body.get("status") or {})


def _fleet(memo: kopf.Memo, namespace: str, spec: crd.LLMServiceSpec) -> rollout.FleetView | None:
    """The rollout of the EdgeFleet whose devices serve this spec, if it names one."""
    if spec.edge.devices is None:
        return None
    name = spec.edge.devices.fleet
    return rollout.FleetView.of(name, memo.fleets.get((namespace, name)))


def serving_devices(
    memo: kopf.Memo, namespace: str, spec: Mapping[str, Any]
) -> tuple[tuple[str, str], ...]:
    """The serving devices of an LLMService's spec.edge.devices: (URL, revision), sorted."""
    selector = ((spec.get("edge") or {}).get("devices")) or {}
    fleet, want = selector.get("fleet"), selector.get("matchLabels") or {}
    if not fleet:
        return ()
    return tuple(sorted(
        (url, revision)
        for (ns, _), (f, labels, url, revision) in memo.devices.items()
        if ns == namespace and f == fleet and all(labels.get(k) == v for k, v in want.items())
    ))  # fmt: skip


@kopf.on.event(*LLMSERVICES)
async def llmservice_event(type: str | None, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    memo.heard.events += 1  # the watch works (the watchdog's sign of progress)
    jobs = memo.jobs.get(_key(meta))
    if jobs and rollout.ACTION_ANNOTATION in (meta.get("annotations") or {}):
        memo.ticker.poke(jobs[1])  # a hand command (`hybridllm rollout ...`): act on it now
    waker = cast(Waker | None, memo.wakers.get(_key(meta)))
    if waker is not None and type != "DELETED" and meta.get("generation") != waker.generation:
        waker.event.set()


@kopf.on.event("", "v1", "pods", labels=OWNED)
async def pod_changed(
    type: str | None, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, **_: Any
) -> None:
    """A pool's pod changed (scheduled, pulling, crashing, ready): the status may say why a
    pool is not ready. Pods belong to ReplicaSets; their LLMService is in their labels."""
    labels = meta.get("labels") or {}
    key = (meta.get("namespace"), labels.get(builders.LABEL_INSTANCE))
    if labels.get(builders.LABEL_COMPONENT) == "gateway":
        _index_gateway(memo, key, type, meta, status)
    waker = cast(Waker | None, memo.wakers.get(key))
    if waker is not None:
        waker.event.set()


def _index_gateway(
    memo: kopf.Memo,
    key: tuple[Any, Any],
    type: str | None,
    meta: kopf.Meta,
    status: Mapping[str, Any],
) -> None:
    """Keep the metrics URL of each Ready gateway pod, for the autoscaler's direct reads."""
    pods = memo.gateways.setdefault(key, {})
    name = str(meta.get("name"))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if type == "DELETED" or meta.get("deletionTimestamp") or not ready or not ip:
        pods.pop(name, None)
    else:
        host = f"[{ip}]" if ":" in str(ip) else ip
        pods[name] = f"http://{host}:{builders.PORT}/metrics"


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
@kopf.on.event("", "v1", "services", labels=OWNED)
@kopf.on.event("", "v1", "configmaps", labels=OWNED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=OWNED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
async def child_changed(
    type: str | None,
    body: kopf.Body,
    meta: kopf.Meta,
    resource: kopf.Resource,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Any event of a child (added, modified, deleted, the initial listing) may be drift
    or a status change: note its version and wake its LLMService's daemon."""
    refs = cast(list[dict[str, Any]], meta.get("ownerReferences") or [])
    for owner in refs:
        if owner.get("kind") == "LLMService" and owner.get("controller"):
            waker = cast(Waker | None, memo.wakers.get((meta.get("namespace"), owner["name"])))
            if waker is not None:
                kind = str(body.get("kind") or resource.kind)
                waker.applied.observe(kind, meta, deleted=type == "DELETED")
                if kind == "Deployment" and type != "DELETED":
                    _say_if_scaled_by_hand(memo, owner, body, meta)
                waker.event.set()


def _say_if_scaled_by_hand(
    memo: kopf.Memo, owner: Mapping[str, Any], body: kopf.Body, meta: kopf.Meta
) -> None:
    """A Deployment whose replicas someone else set while the autoscaler owns them: the
    reconcile sets them back; an Event on the LLMService says who and why."""
    scaling = memo.scalers.get((meta.get("namespace"), owner["name"]))
    component = (meta.get("labels") or {}).get(builders.LABEL_COMPONENT)
    if scaling is None or not scaling.applies or component not in scaling.desired:
        return
    replicas = (body.get("spec") or {}).get("replicas")
    by = replicas_manager(meta)
    if by is None or replicas == scaling.desired[component]:
        return
    ref = {
        "apiVersion": crd.API_VERSION, "kind": "LLMService", "metadata": {
            "name": owner["name"], "namespace": meta.get("namespace"), "uid": owner.get("uid"),
        },
    }  # fmt: skip
    kopf.event(
        cast(kopf.Body, ref),
        type="Warning",
        reason="ReplicasReverted",
        message=(
            f"{meta.get('name')} was scaled to {replicas} by {by}; autoscaling (mode "
            f"{scaling.mode}) owns the replicas of {component} and sets them back to "
            f"{scaling.desired[component]}. To let an HPA or KEDA own them, set "
            "spec.autoscaling.mode to external"
        ),
    )


def replicas_manager(meta: Mapping[str, Any]) -> str | None:
    """The field manager other than the operator that owns a Deployment's spec.replicas."""
    for entry in meta.get("managedFields") or []:
        fields = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in fields and entry.get("manager") != reconcile.FIELD_MANAGER:
            return str(entry.get("manager"))
    return None
