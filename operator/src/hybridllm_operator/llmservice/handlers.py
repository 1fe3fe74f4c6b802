"""kopf wiring of LLMServices: one reconciler daemon per LLMService, woken by events.

kopf runs a daemon per LLMService for as long as the object exists (spawned when it is
created or when the operator starts, stopped when it is deleted). The daemon is the only
place that reconciles its LLMService, so one LLMService is never reconciled twice at once
(a child's status change can no longer race the parent's own reconcile or its status
patch). Everything else only wakes it:

- an event of the LLMService whose ``metadata.generation`` differs from the last one
  reconciled (a spec change; the daemon's own status patches do not wake it);
- any event of an owned child (a Deployment's status, a hand edit, a deletion): found by
  its controller ``ownerReference``, without asking the API server for the parent;
- a change of the EdgeDevices or EdgeFleets it serves from (``edgefleet/handlers.py``).

A burst of events coalesces into one reconcile. A reconcile that fails on the API server
(409, 429, 5xx, a lost connection) is retried by the daemon with back-off (1 s doubling
to 60 s) until it succeeds; a spec that can never work is reported as ``Degraded`` and
waits for the next spec change; and every ``resync_seconds`` (default an hour) the
daemon reconciles anyway, as a safety net for an event lost while the watch reconnected.

The periodic work of each LLMService (its autoscaler, its rollout) runs as jobs of the
operator's one ticker (jobs.py). The metrics URLs of Ready gateway pods are a kopf index
(``gateway_metrics``), not a map kept by hand. Daemons need kopf's finalizer on each
LLMService, so that deleting one stops its daemon first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_operator.edgefleet.handlers import serving_devices
from hybridllm_operator.llmservice import autoscaling, builders, reconcile, rollout
from hybridllm_operator.llmservice.jobs import AutoscalerJob, RolloutJob, ServiceState, Waker, _post

LLMSERVICES = (crd.GROUP, crd.VERSION, "llmservices")
Logger = logging.Logger | logging.LoggerAdapter[Any]
OWNED = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
TRANSIENT_STATUSES = (409, 429, 500, 502, 503, 504)


def _key(meta: Mapping[str, Any]) -> tuple[str, str]:
    return str(meta.get("namespace")), str(meta.get("name"))


async def _sleep_until_woken(waker: Waker, timeout: float | None) -> bool:
    """Whether an event woke it (False: the timeout did)."""
    try:
        await asyncio.wait_for(waker.event.wait(), timeout)
    except TimeoutError:
        return False
    return True


def _state(
    memo: kopf.Memo, key: tuple[str, str], body: kopf.Body, gateway_metrics: kopf.Index[Any, str]
) -> ServiceState:
    """This LLMService's state for its daemon's life: its autoscaler made from the state
    saved in the annotation (what it set before a restart), its rollout controller from
    ``status.rollout`` (the step a restarted operator was at)."""
    scaling = autoscaling.ServiceAutoscaler(
        bin_s=memo.forecast_bin_s, model=memo.forecast_model, season_s=memo.forecast_season_s
    )
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    scaling.restore(annotations.get(autoscaling.STATE_ANNOTATION))
    return ServiceState(
        key=key,
        scaling=scaling,
        rollouts=rollout.Controller((body.get("status") or {}).get("rollout")),
        gateway_urls=lambda: list(gateway_metrics.get(key, [])),
    )


@kopf.index("", "v1", "pods", labels=OWNED)
def gateway_metrics(
    meta: kopf.Meta, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], str] | None:
    """The metrics URL of each Ready gateway pod, by its LLMService: the autoscaler's and
    the rollout's direct reads when there is no Prometheus."""
    labels = meta.get("labels") or {}
    if labels.get(builders.LABEL_COMPONENT) != "gateway" or meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    ip = status.get("podIP")
    if not ready or not ip:
        return None
    host = f"[{ip}]" if ":" in str(ip) else ip
    key = (str(meta.get("namespace")), str(labels.get(builders.LABEL_INSTANCE)))
    return {key: f"http://{host}:{builders.PORT}/metrics"}


@kopf.daemon(*LLMSERVICES, cancellation_timeout=30.0)
async def reconciler(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, logger: Logger, **kwargs: Any
) -> None:
    """Reconcile this LLMService now, then each time something wakes it, until deleted.
    Its autoscaler and its rollout run as jobs of the operator's one `Ticker` for as long
    as this daemon does."""
    key = _key(meta)
    state = _state(memo, key, body, kwargs["gateway_metrics"])  # kopf's index (below)
    waker, scaling, rollouts = state.waker, state.scaling, state.rollouts
    memo.services[key] = state
    memo.ticker.start()
    jobs = [AutoscalerJob(state, body, memo, logger), RolloutJob(state, body, memo, logger)]
    state.jobs = jobs
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
            except crd.InvalidSpec as exc:
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
        if memo.services.get(key) is state:  # the object is gone (or the operator stops)
            del memo.services[key]


def _namespace_terminating(exc: Exception) -> bool:
    """The API server refused a write because the namespace is being deleted."""
    return (
        isinstance(exc, k8s_errors.ApiException)
        and exc.status == 403
        and "NamespaceTerminating" in str(exc.body or "")
    )


@kopf.on.event(*LLMSERVICES)
async def llmservice_event(type: str | None, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    memo.heard.events += 1  # the watch works (the watchdog's sign of progress)
    state = cast(ServiceState | None, memo.services.get(_key(meta)))
    if state is None:
        return
    if state.jobs and rollout.ACTION_ANNOTATION in (meta.get("annotations") or {}):
        memo.ticker.poke(state.jobs[1])  # a hand command (`hybridllm rollout ...`): now
    waker = state.waker
    if type != "DELETED" and meta.get("generation") != waker.generation:
        waker.event.set()


@kopf.on.event("", "v1", "pods", labels=OWNED)
async def pod_changed(
    type: str | None, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, **_: Any
) -> None:
    """A pool's pod changed (scheduled, pulling, crashing, ready): the status may say why a
    pool is not ready. Pods belong to ReplicaSets; their LLMService is in their labels."""
    labels = meta.get("labels") or {}
    state = memo.services.get((meta.get("namespace"), labels.get(builders.LABEL_INSTANCE)))
    if state is not None:
        state.waker.event.set()


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
            state = cast(
                ServiceState | None, memo.services.get((meta.get("namespace"), owner["name"]))
            )
            if state is not None:
                kind = str(body.get("kind") or resource.kind)
                state.waker.applied.observe(kind, meta, deleted=type == "DELETED")
                if kind == "Deployment" and type != "DELETED":
                    _say_if_scaled_by_hand(state.scaling, owner, body, meta)
                state.waker.event.set()


def _say_if_scaled_by_hand(
    scaling: autoscaling.ServiceAutoscaler,
    owner: Mapping[str, Any],
    body: kopf.Body,
    meta: kopf.Meta,
) -> None:
    """A Deployment whose replicas someone else set while the autoscaler owns them: the
    reconcile sets them back; an Event on the LLMService says who and why."""
    component = (meta.get("labels") or {}).get(builders.LABEL_COMPONENT)
    if not scaling.applies or component not in scaling.desired:
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
