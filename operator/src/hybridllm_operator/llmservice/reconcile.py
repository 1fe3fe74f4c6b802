"""Level-triggered reconciliation of one LLMService.

Each call reads the world and converges it, so it is safe to run any number of times
and from any trigger (the LLMService changed, one of its children changed or vanished,
the operator restarted):

1. parse the spec; a spec that can never work raises :class:`crd.InvalidSpec` after the
   status says why (``Degraded``, naming the field);
2. server-side apply every desired child with ``force`` (the operator owns those
   fields: a hand edit is reverted, a deleted object comes back);
3. delete children of this instance that are no longer desired (a mode switch from
   monolithic to disaggregated removes the monolithic pool);
4. rebuild the status from the Deployments that now exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client import exceptions as k8s_errors

from hybridllm_common import crd
from hybridllm_operator.llmservice import autoscaling, builders, rollout, status

log = logging.getLogger(__name__)

FIELD_MANAGER = builders.MANAGED_BY

# Child kinds the operator owns, for applying and pruning.
CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


@dataclass
class Cluster:
    """The API clients one operator process shares between handler threads."""

    api: client.ApiClient
    dyn: dynamic.DynamicClient

    @classmethod
    def connect(cls, api: client.ApiClient | None = None) -> Cluster:
        api = api or client.ApiClient()
        return cls(api=api, dyn=dynamic.DynamicClient(api))  # type: ignore[no-untyped-call]

    def resource(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def llmservices(self) -> Any:
        return self.resource(crd.API_VERSION, "LLMService")


def _instance_selector(name: str) -> str:
    return f"{builders.LABEL_INSTANCE}={name},{builders.LABEL_MANAGED_BY}={builders.MANAGED_BY}"


def manifest_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _version(kind: str, meta: Mapping[str, Any]) -> str:
    """What changes when someone else changes a child's desired state: the generation of
    objects that have one (a status update leaves it alone), else the resourceVersion."""
    if kind in ("Deployment", "PodDisruptionBudget") and meta.get("generation") is not None:
        return f"g{meta['generation']}"
    return f"r{meta.get('resourceVersion')}"


@dataclass
class Applied:
    """What one LLMService's reconciles last applied, and what its children's events say
    of them since, so that a reconcile costs what changed.

    A child is applied again only when its desired manifest changed, or when it changed
    (or vanished) after our apply: its generation (resourceVersion for kinds without one)
    differs from the one our apply produced. Children are pruned only when the set of
    desired children changed. An empty record (an operator just started) applies and
    prunes everything once.
    """

    hashes: dict[tuple[str, str], str] = field(default_factory=dict)
    ours: dict[tuple[str, str], str] = field(default_factory=dict)  # version our apply made
    seen: dict[tuple[str, str], str | None] = field(default_factory=dict)  # None: deleted
    pruned_for: frozenset[tuple[str, str]] | None = None
    # The status our last patch wrote. The object a reconcile is given comes from a watch
    # and may not show that patch yet: compared with such a stale view, a new status that
    # equals an older one would be taken as unchanged and never written.
    status: dict[str, Any] | None = None

    def observe(self, kind: str, meta: Mapping[str, Any], deleted: bool) -> None:
        """A child's event: remember its version (or that it is gone)."""
        self.seen[(kind, str(meta.get("name")))] = None if deleted else _version(kind, meta)

    def current(self, key: tuple[str, str], digest: str) -> bool:
        if self.hashes.get(key) != digest or key not in self.ours:
            return False
        return self.seen.get(key, self.ours[key]) == self.ours[key]

    def record(self, key: tuple[str, str], digest: str, result: Mapping[str, Any]) -> None:
        self.hashes[key] = digest
        self.ours[key] = self.seen[key] = _version(key[0], result.get("metadata") or {})


def apply_children(
    cluster: Cluster, service: builders.Service, applied: Applied | None = None
) -> list[dict[str, Any]]:
    ensure_token_secret(cluster, service, applied)
    desired = builders.build_children(service)
    for obj in desired:
        key, digest = (obj["kind"], obj["metadata"]["name"]), manifest_hash(obj)
        if applied is not None and applied.current(key, digest):
            continue
        result = cluster.resource(obj["apiVersion"], obj["kind"]).server_side_apply(
            body=obj,
            name=obj["metadata"]["name"],
            namespace=service.namespace,
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        if applied is not None:
            applied.record(key, digest, result.to_dict())
    return desired


def ensure_token_secret(
    cluster: Cluster, service: builders.Service, applied: Applied | None = None
) -> None:
    """The backend token's Secret (isolation.py), made once: an existing one is kept as it
    is (a new token would lock the running pods out until they restarted)."""
    secret = builders.build_token_secret(service)
    key = ("Secret", secret["metadata"]["name"])
    if applied is not None and key in applied.ours:
        return
    try:
        cluster.resource("v1", "Secret").create(body=secret, namespace=service.namespace)
    except k8s_errors.ApiException as exc:
        if exc.status != 409:  # 409: it exists
            raise
    if applied is not None:
        applied.ours[key] = applied.seen[key] = ""


def prune_children(
    cluster: Cluster, service: builders.Service, desired: list[dict[str, Any]]
) -> list[str]:
    """Delete owned children that the spec no longer asks for; returns 'Kind/name' of each."""
    keep = {(obj["kind"], obj["metadata"]["name"]) for obj in desired}
    deleted = []
    for api_version, kind in CHILD_KINDS:
        existing = cluster.resource(api_version, kind).get(
            namespace=service.namespace, label_selector=_instance_selector(service.name)
        )
        for item in existing.items:
            owners = item.metadata.get("ownerReferences") or []
            if (kind, item.metadata.name) in keep or not any(
                o.get("uid") == service.uid for o in owners
            ):
                continue
            try:
                cluster.resource(api_version, kind).delete(
                    name=item.metadata.name, namespace=service.namespace
                )
            except k8s_errors.ApiException as exc:
                if exc.status != 404:
                    raise
            deleted.append(f"{kind}/{item.metadata.name}")
    return deleted


def list_deployments(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    result = cluster.resource("apps/v1", "Deployment").get(
        namespace=namespace, label_selector=_instance_selector(name)
    )
    return [item.to_dict() for item in result.items]


def list_pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    result = cluster.resource("v1", "Pod").get(
        namespace=namespace, label_selector=_instance_selector(name)
    )
    return [item.to_dict() for item in result.items]


def patch_status(
    cluster: Cluster,
    namespace: str,
    name: str,
    new_status: crd.LLMServiceStatus,
    previous: dict[str, Any],
) -> None:
    body = {"status": new_status.model_dump(mode="json", by_alias=True, exclude_none=True)}
    # A merge patch keeps map keys it does not mention: null out pools that no longer exist,
    # and the rollout's fields that are unset now.
    pools = body["status"].setdefault("pools", {})
    for gone in set(previous.get("pools") or {}) - set(pools):
        pools[gone] = None
    if new_status.rollout is not None:
        body["status"]["rollout"] = new_status.rollout.model_dump(mode="json", by_alias=True)
    cluster.llmservices().subresources["status"].patch(
        name=name, namespace=namespace, body=body, content_type="application/merge-patch+json"
    )


def _service_from(
    body: dict[str, Any],
    spec: crd.LLMServiceSpec,
    images: builders.Images,
    scaled: dict[str, int] | None = None,
    rollout_state: crd.RolloutStatus | None = None,
    devices: tuple[builders.ServingDevice, ...] = (),
) -> builders.Service:
    meta = body["metadata"]
    return builders.Service(
        name=meta["name"], namespace=meta["namespace"], uid=meta["uid"], spec=spec,
        images=images, scaled=scaled or {}, rollout=rollout_state, devices=devices,
    )  # fmt: skip


def observed_pools(
    deployments: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> dict[str, autoscaling.Observed]:
    """Each pool's replicas, ready replicas and unschedulable pods, for the autoscaler."""
    stuck = status.unschedulable(pods)
    out = {}
    for deployment in deployments:
        labels = deployment["metadata"].get("labels") or {}
        component = labels.get(builders.LABEL_COMPONENT)
        if component is None or builders.is_canary(labels):  # the stable pools are scaled
            continue
        out[component] = autoscaling.Observed(
            replicas=(deployment.get("spec") or {}).get("replicas") or 0,
            ready=(deployment.get("status") or {}).get("readyReplicas") or 0,
            unschedulable=stuck.get(component, 0),
        )
    return out


def readiness(
    service: builders.Service, deployments: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> rollout.Readiness:
    """Whether each revision's pools are rolled out and available, for the rollout."""
    pending = status.rollouts_pending(deployments)
    by_key = {status.pool_key(d["metadata"].get("labels")): d for d in deployments}

    def ready(pools: list[builders.Pool], track: str | None) -> bool:
        for pool in pools:
            key = f"{pool.component}-{track}" if track else pool.component
            d = by_key.get(key)
            if d is None or key in pending:
                return False
            labels = d["metadata"].get("labels") or {}
            if labels.get(builders.LABEL_REVISION) != pool.revision:
                return False
            if (d.get("spec") or {}).get("replicas", 1) and not (d.get("status") or {}).get(
                "readyReplicas"
            ):
                return False
        return True

    canary = service.canary
    problems = status.pod_problems(pods)
    stuck = status.unschedulable(pods)
    canary_problem = next(
        (
            f"{k}: {v}"
            for k, v in sorted(problems.items())
            if k.endswith("-canary") and not v.startswith(status.UNSCHEDULABLE)
        ),
        None,
    )
    canary_pools = (
        builders.model_pools(service, canary, builders.CANARY) if canary is not None else []
    )
    # The canary moves traffic only with every replica of its size for the step up: the
    # surge is in place first. Short pools, and why the scheduler cannot place one.
    short, unschedulable = [], None
    for pool in canary_pools:
        d = by_key.get(f"{pool.component}-{builders.CANARY}") or {}
        want = (d.get("spec") or {}).get("replicas", 0) or 0
        have = (d.get("status") or {}).get("readyReplicas") or 0
        if have < want:
            short.append(f"{pool.component} {have}/{want} ready")
        key = f"{pool.component}-{builders.CANARY}"
        if stuck.get(key) and unschedulable is None:
            unschedulable = f"{key}: {problems.get(key) or status.UNSCHEDULABLE}"
    return rollout.Readiness(
        canary_ready=canary is not None and ready(canary_pools, builders.CANARY) and not short,
        stable_ready=ready(builders.model_pools(service, service.stable), None),
        canary_problem=canary_problem,
        canary_short=", ".join(short) or None,
        canary_unschedulable=unschedulable,
    )


def reconcile(
    cluster: Cluster,
    body: dict[str, Any],
    images: builders.Images,
    applied: Applied | None = None,
    scaling: autoscaling.ServiceAutoscaler | None = None,
    rollouts: rollout.Controller | None = None,
    devices: tuple[builders.ServingDevice, ...] = (),
) -> crd.LLMServiceStatus:
    """Converge one LLMService (given as its API object) and return the status written.

    With ``applied`` (kept per LLMService between reconciles), unchanged children are not
    applied again, children are pruned only when the desired set changed, and an
    unchanged status is not written. With ``scaling``, the pools get the autoscaler's
    replicas, the status its decisions, and the autoscaler what the pools look like.
    ``devices`` are the serving edge devices (URL, revision) the routing table lists.
    """
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    seen = body.get("status") or {}
    previous = applied.status if applied is not None and applied.status is not None else seen
    # Pools to null out in the merge patch: those either view still lists.
    known = {"pools": {**(seen.get("pools") or {}), **(previous.get("pools") or {})}}
    try:
        spec = crd.parse_spec(name, body.get("spec") or {})
    except crd.InvalidSpec as exc:
        _write_status(
            cluster, namespace, name, status.invalid_status(generation, previous, str(exc)),
            known, applied,
        )  # fmt: skip
        raise
    if scaling is not None:
        scaling.configure(spec)
    rollout_state = None
    if rollouts is not None:  # a spec change may start (or end) a rollout
        spec_only = rollout.Observation(time.time(), spec_only=True)
        for _, reason, message in rollouts.advance(spec, spec_only):
            log.info("%s/%s rollout: %s: %s", namespace, name, reason, message)
        rollout_state = rollouts.state
    service = _service_from(
        body, spec, images, scaling.replicas() if scaling else None, rollout_state, devices
    )
    if forecast := rollout.canary_forecast(scaling, rollout_state, spec):
        service = replace(service, forecast=forecast)
    if scaling is not None:
        _decisions_first(cluster, namespace, name, scaling, previous, applied)
    desired = apply_children(cluster, service, applied)
    keys = frozenset((o["kind"], o["metadata"]["name"]) for o in desired)
    if applied is None or applied.pruned_for != keys:
        deleted = prune_children(cluster, service, desired)
        if deleted:
            log.info(
                "removed %s no longer in the spec of %s/%s", ", ".join(deleted), namespace, name
            )
        if applied is not None:
            applied.pruned_for = keys
    deployments = list_deployments(cluster, namespace, name)
    new_status = status.build_status(service, generation, deployments, previous, (), scaling)
    pods: list[dict[str, Any]] = []
    if not status.is_ready(new_status) or service.canary is not None:
        pods = list_pods(cluster, namespace, name)  # what keeps a pool from running
        new_status = status.build_status(service, generation, deployments, previous, pods, scaling)
    if scaling is not None:
        scaling.observed = observed_pools(deployments, pods)
    if rollouts is not None:
        rollouts.readiness = readiness(service, deployments, pods)
    wire = new_status.model_dump(mode="json", by_alias=True, exclude_none=True)
    if applied is None or wire != previous:
        _write_status(cluster, namespace, name, new_status, known, applied)
    return new_status


def decision_patch(
    scaling: autoscaling.ServiceAutoscaler, previous: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The status of each existing pool whose replicas the autoscaler changes: the new
    ``desiredReplicas`` and the decision that explains it (None clears a field)."""
    pools = previous.get("pools") or {}
    replicas = scaling.replicas()
    patch: dict[str, dict[str, Any]] = {}
    for component, decision in scaling.decisions.items():
        old = pools.get(component)
        if old is None or component not in replicas:
            continue  # a new pool's status comes with it; advisory modes change no replicas
        if old.get("desiredReplicas") == replicas[component]:
            continue
        fields = {
            crd.PoolStatus.model_fields[k].alias or k: v
            for k, v in autoscaling.pool_fields(decision).items()
        }
        patch[component] = {**fields, "desiredReplicas": replicas[component]}
    return patch


def _decisions_first(
    cluster: Cluster,
    namespace: str,
    name: str,
    scaling: autoscaling.ServiceAutoscaler,
    previous: Mapping[str, Any],
    applied: Applied | None,
) -> None:
    """Write the autoscaler's new replicas and their reason to the status before the
    Deployments take them: whoever sees a pool scaled (``kubectl get deploy``, a watch)
    then finds the decision that did it in the status, never the one before it."""
    patch = decision_patch(scaling, previous)
    if not patch:
        return
    if applied is not None:
        applied.status = None  # the full status below is written again
    cluster.llmservices().subresources["status"].patch(
        name=name,
        namespace=namespace,
        body={"status": {"pools": patch}},
        content_type="application/merge-patch+json",
    )


def _write_status(
    cluster: Cluster,
    namespace: str,
    name: str,
    new_status: crd.LLMServiceStatus,
    known: dict[str, Any],
    applied: Applied | None,
) -> None:
    """Patch the status and remember what was written (forgotten if the patch failed: it
    may or may not have landed, so the next reconcile writes it again)."""
    if applied is not None:
        applied.status = None
    patch_status(cluster, namespace, name, new_status, known)
    if applied is not None:
        applied.status = new_status.model_dump(mode="json", by_alias=True, exclude_none=True)
