"""The periodic work of every LLMService, run from one task: its autoscaler every
``spec.autoscaling.intervalSeconds`` and its rollout every few seconds are `Job` objects
that the operator's one `Ticker` runs when they are due, for as long as the LLMService's
reconciler (handlers.py) runs; each hands what it decided to the reconciler through the
service's `Waker`. Before, each was a kopf daemon of its own: three tasks and their timers
per LLMService, which at a thousand services kept an idle operator busy.

What the operator holds of one LLMService while its reconciler runs is one
`ServiceState` (its waker, autoscaler, rollout controller, jobs, parsed spec and gateway
pods), made when the daemon starts and dropped when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_forecaster.autoscaler import DECIDING
from hybridllm_operator.llmservice import analysis, autoscaling, demand, reconcile, rollout

Logger = logging.Logger | logging.LoggerAdapter[Any]

FAILED_JOB_RETRY_S = 60.0  # a job that failed on a bug looks again after this long


@dataclasses.dataclass
class Waker:
    """How events reach one LLMService's daemon."""

    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    generation: int | None = None  # the last generation reconciled (or found invalid)
    reconciles: int = 0
    applied: reconcile.Applied = dataclasses.field(default_factory=reconcile.Applied)


@dataclasses.dataclass(eq=False)
class ServiceState:
    """One LLMService, as the operator holds it while its reconciler daemon runs: how
    events wake the daemon, the autoscaler and rollout controller its reconciles and its
    jobs share, the jobs, its spec parsed once per generation, and the metrics URLs of its
    Ready gateway pods (kopf's index of them, read through ``gateway_urls``)."""

    key: tuple[str, str]
    scaling: autoscaling.ServiceAutoscaler
    rollouts: rollout.Controller
    gateway_urls: Callable[[], list[str]]
    waker: Waker = dataclasses.field(default_factory=Waker)
    jobs: list[Job] = dataclasses.field(default_factory=list)
    parsed: tuple[Any, crd.LLMServiceSpec | None] | None = None

    def spec(self, body: Mapping[str, Any]) -> crd.LLMServiceSpec | None:
        """The object's spec, or None when it is invalid (the reconciler says why in the
        status). Parsed once per generation: the jobs look every few seconds, the spec
        changes only with ``metadata.generation``."""
        generation = (body.get("metadata") or {}).get("generation")
        if self.parsed is not None and self.parsed[0] == generation and generation is not None:
            return self.parsed[1]
        try:
            spec: crd.LLMServiceSpec | None = crd.parse_spec(
                self.key[1], dict(body.get("spec") or {})
            )
        except crd.InvalidSpec:
            spec = None
        self.parsed = (generation, spec)
        return spec


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
            wait = FAILED_JOB_RETRY_S
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
        self, state: ServiceState, body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        self.state, self.body, self.memo, self.logger = state, body, memo, logger
        self.key = state.key
        self.stopped = False
        self.running = False
        self.poked = False
        self.entry = 0  # the ticker's heap entry that counts (older ones are skipped)

    async def __call__(self) -> float:
        raise NotImplementedError


def _post(body: kopf.Body, controller: Any, logger: Logger) -> None:
    for type_, reason, message in controller.take_events():
        kopf.event(body, type=type_, reason=reason, message=message)
        logger.info("rollout: %s: %s", reason, message)


PERSIST_EVERY_S = 60.0  # the autoscaler's state is saved at least this often while it runs


def _demand_source(memo: kopf.Memo, state: ServiceState) -> demand.DemandSource:
    key = state.key
    source: demand.DemandSource
    if memo.prometheus_url:
        source = demand.PrometheusDemand(
            memo.prometheus_url, key[0], key[1], bin_s=memo.forecast_bin_s,
            rate_window_s=memo.rate_window_s, batch=memo.prometheus_batch,
        )  # fmt: skip
    else:
        source = demand.GatewayScrape(state.gateway_urls, bin_s=memo.forecast_bin_s)
    return demand.WithStranded(source, memo.forecast_bin_s, lambda: _stranded(memo, state))


def _stranded(memo: kopf.Memo, state: ServiceState) -> list[demand.StrandedMinute]:
    """The minutes of cloud-bound demand the sites of the service's EdgeFleet refused while
    the cloud was unreachable from them (the fleet's status, as the fleet server wrote it)."""
    spec = state.parsed[1] if state.parsed else None
    devices = spec.edge.devices if spec is not None else None
    if devices is None:
        return []
    status = memo.fleets.get((state.key[0], devices.fleet)) or {}
    out = []
    for b in status.get("strandedDemand") or ():
        try:
            out.append((int(b["start"]), float(b["promptTokens"]), float(b["completionTokens"])))
        except (KeyError, TypeError, ValueError):
            continue  # the CRD's schema admits none such; a hand-edited status is skipped
    return out


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
        self, state: ServiceState, body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        super().__init__(state, body, memo, logger)
        self.source: demand.DemandSource | None = None
        self.shown: Any = None
        self.saved_at = 0.0
        self.saved: str | None = None
        self.advised: dict[str, int] = {}  # the last recommendation per pool (advisory mode)

    async def __call__(self) -> float:
        memo, key, body, state = self.memo, self.key, self.body, self.state
        scaling = state.scaling
        spec = state.spec(body)
        if spec is None:
            return 15.0
        scaling.configure(spec)
        if scaling.mode in DECIDING and scaling.observed:
            loop = asyncio.get_running_loop()
            self.source = self.source or _demand_source(memo, state)
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
            if changed or _visible(scaling) != self.shown:
                self.shown = _visible(scaling)
                state.waker.event.set()
            saved = json.dumps(scaling.state(), separators=(",", ":"))
            if saved != self.saved and (changed or time.time() - self.saved_at >= PERSIST_EVERY_S):
                try:
                    await loop.run_in_executor(
                        memo.executor,
                        _annotate,
                        memo.cluster,
                        key[0],
                        key[1],
                        autoscaling.STATE_ANNOTATION,
                        saved,
                    )
                    self.saved, self.saved_at = saved, time.time()
                except (k8s_errors.ApiException, OSError) as exc:
                    self.logger.info("autoscaler state not saved (retrying later): %s", exc)
        # The next boundary of the interval on the wall clock: every LLMService of one
        # interval reads at the same moment, so with Prometheus they share one answer.
        interval = float(spec.autoscaling.interval_seconds)
        return interval - time.time() % interval + BOUNDARY_SLACK_S


BOUNDARY_SLACK_S = 0.01  # wake just past the boundary, never just before it


def _windows(memo: kopf.Memo, state: ServiceState) -> analysis.WindowSource:
    if memo.prometheus_url:
        return analysis.PrometheusWindows(memo.prometheus_url, *state.key)
    return analysis.ScrapeWindows(state.gateway_urls)


class RolloutJob(Job):
    """Drive this LLMService's rollout: wait for the canary's pools and the gateways,
    analyse each step's window, act on hand commands (the ``hybridllm.io/rollout-action``
    annotation, removed once acted on) and hand each new state to the reconciler, which
    renders the pools and weights and writes ``status.rollout``."""

    what = "rollout"

    def __init__(
        self, state: ServiceState, body: kopf.Body, memo: kopf.Memo, logger: Logger
    ) -> None:
        super().__init__(state, body, memo, logger)
        self.source: analysis.WindowSource | None = None
        # what a fleet's devices report, for a step that moves them (through Prometheus,
        # which scrapes the fleet server; without it such a step is judged on the gateways
        # alone)
        self.kpis = (
            analysis.PrometheusDeviceKpis(memo.prometheus_url) if memo.prometheus_url else None
        )

    async def __call__(self) -> float:
        memo, key, body, state = self.memo, self.key, self.body, self.state
        controller = state.rollouts
        spec = state.spec(body)
        if spec is None or controller.state is None:
            return ROLLOUT_IDLE_S  # the reconcile pokes it when a rollout starts
        loop = asyncio.get_running_loop()
        action = (body.get("metadata", {}).get("annotations") or {}).get(rollout.ACTION_ANNOTATION)
        self.source = self.source or _windows(memo, state)
        try:
            fleet = _fleet(memo, key[0], spec)
            scaling = state.scaling
            profile = scaling.day_profile() if rollout.is_scheduled(controller.state) else None
            obs = await loop.run_in_executor(
                memo.scale_executor, rollout.look, controller, spec, self.source, action,
                fleet, self.kpis, profile, scaling.forecast_need,
            )  # fmt: skip
            if self.stopped:
                return 0.0
            before = controller.state
            controller.advance(spec, obs)
            if controller.state != before:
                state.waker.event.set()
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


def _fleet(memo: kopf.Memo, namespace: str, spec: crd.LLMServiceSpec) -> rollout.FleetView | None:
    """The rollout of the EdgeFleet whose devices serve this spec, if it names one."""
    if spec.edge.devices is None:
        return None
    name = spec.edge.devices.fleet
    return rollout.FleetView.of(name, memo.fleets.get((namespace, name)))
