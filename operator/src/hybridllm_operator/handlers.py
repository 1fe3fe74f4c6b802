"""kopf handlers: thin triggers around :func:`hybridllm_operator.reconcile.reconcile`.

Every trigger runs the same level-triggered reconcile: the LLMService was created,
its spec changed, the operator resumed, or one of its children changed or was deleted
(the child watch is what repairs drift and keeps the status's ready counts current).
kopf keeps its bookkeeping in annotations, not in ``status``, because the CRD's status
schema is structural and would prune anything kopf wrote there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf
import kubernetes
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_operator import builders, reconcile
from hybridllm_operator.settings import OperatorSettings

LLMSERVICES = (crd.GROUP, crd.VERSION, "llmservices")
Logger = logging.Logger | logging.LoggerAdapter[Any]
OWNED = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}

_state: dict[str, Any] = {}


class _QuietChildEvents(logging.Filter):
    """Drop kopf's per-event success line for child watches: one per Deployment status change."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Handler 'child_changed' succeeded" not in record.getMessage()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: Logger, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations: the structural status schema
    # would prune kopf's status fields and make it re-run handlers forever.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=crd.GROUP, key="last-handled-configuration"
    )
    # Kubernetes Events only for warnings and errors: successful reconciles are frequent.
    settings.posting.level = logging.WARNING
    # One operator replica (leader election is the Deployment's job): no peering CRD needed.
    settings.peering.standalone = True
    # Reconciles are short, blocking API calls: run them in a bounded thread pool.
    operator_settings = OperatorSettings()
    settings.execution.max_workers = operator_settings.max_workers
    # A transient API error retries soon rather than after kopf's default minute.
    settings.watching.reconnect_backoff = 1.0
    try:
        kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
    logging.getLogger("kopf.objects").addFilter(_QuietChildEvents())
    _state["cluster"] = reconcile.Cluster.connect()
    _state["images"] = operator_settings.images()
    logger.info("hybridllm operator configured: images %s", _state["images"])


def _reconcile(body: kopf.Body, logger: Logger) -> None:
    try:
        result = reconcile.reconcile(_state["cluster"], dict(body), _state["images"])
    except reconcile.InvalidSpec as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except k8s_errors.ApiException as exc:
        if exc.status in (409, 429, 500, 503, 504):
            raise kopf.TemporaryError(
                f"API server answered {exc.status}: {exc.reason}", delay=5
            ) from exc
        raise
    logger.debug("reconciled: edge %s, cloud %s", result.edge_replicas, result.cloud_replicas)


@kopf.on.resume(*LLMSERVICES)
@kopf.on.create(*LLMSERVICES)
@kopf.on.update(*LLMSERVICES, field="spec")
def llmservice_changed(body: kopf.Body, logger: Logger, **_: Any) -> None:
    _reconcile(body, logger)


def _owner_changed(meta: Mapping[str, Any], logger: Logger) -> None:
    refs = cast(list[dict[str, Any]], meta.get("ownerReferences") or [])
    owners = [o for o in refs if o.get("kind") == "LLMService"]
    if not owners:
        return
    cluster: reconcile.Cluster = _state["cluster"]
    try:
        parent = (
            cluster.llmservices().get(name=owners[0]["name"], namespace=meta["namespace"]).to_dict()
        )
    except k8s_errors.ApiException as exc:
        if exc.status == 404:
            return  # the owner is being deleted; garbage collection removes the child
        raise
    if parent["metadata"].get("deletionTimestamp") or parent["metadata"]["uid"] != owners[0].get(
        "uid"
    ):
        return
    try:
        reconcile.reconcile(cluster, parent, _state["images"])
    except reconcile.InvalidSpec:
        logger.debug("owner %s has an invalid spec; its status says why", owners[0]["name"])


@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
@kopf.on.event("", "v1", "services", labels=OWNED)
@kopf.on.event("", "v1", "configmaps", labels=OWNED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=OWNED)
def child_changed(meta: kopf.Meta, logger: Logger, **_: Any) -> None:
    # Any event (added, modified, deleted, or the initial listing) may mean drift.
    _owner_changed(meta, logger)
