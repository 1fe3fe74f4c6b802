"""Status from what exists: pool replicas read from the Deployments, and the three conditions.

A pool is ready the way ``kubectl rollout status`` decides it, not from ``readyReplicas``
alone (which still counts the old revision's pods while a new one rolls out): the
Deployment controller has observed the current spec (``observedGeneration``), every
replica is updated, no old replica is left, and every updated replica is available. So
``Ready`` and the revision column change only when the new pods serve.

Pure functions over plain dicts, so the rules are tested without a cluster. A
condition's ``lastTransitionTime`` moves only when its status changes, so a status that
has not changed patches to the same bytes and writes nothing.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from hybridllm_common import crd
from hybridllm_operator.llmservice import autoscaling, builders, rollout

CLOUD_COMPONENTS = ("monolithic", "prefill", "decode")


def now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def rollout_pending(deployment: Mapping[str, Any]) -> str | None:
    """Why the Deployment's rollout is not complete (``kubectl rollout status``); None if done."""
    generation = (deployment.get("metadata") or {}).get("generation") or 0
    status = deployment.get("status") or {}
    if (status.get("observedGeneration") or 0) < generation:
        return "the new spec is not observed yet"
    want = (deployment.get("spec") or {}).get("replicas", 1)
    updated = status.get("updatedReplicas") or 0
    if updated < want:
        return f"{updated} of {want} replicas updated"
    total = status.get("replicas") or 0
    if total > updated:
        return f"{total - updated} old replicas pending termination"
    available = status.get("availableReplicas") or 0
    if available < updated:
        return f"{available} of {updated} updated replicas available"
    return None


def pool_key(labels: Mapping[str, str] | None) -> str | None:
    """The status key of a child's pool: its component, ``<component>-canary`` for a
    rollout's canary pools."""
    component = (labels or {}).get(builders.LABEL_COMPONENT)
    if component is not None and builders.is_canary(labels):
        return f"{component}-{builders.CANARY}"
    return component


def rollouts_pending(deployments: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Pool -> why its rollout is not complete, for the pools still rolling out."""
    out = {}
    for deployment in deployments:
        labels = deployment.get("metadata", {}).get("labels") or {}
        component = pool_key(labels)
        pending = rollout_pending(deployment)
        if component is not None and pending is not None:
            out[component] = pending
    return out


# Waiting reasons that do not clear by themselves: the pool cannot become ready until the
# image, the spec or the cluster changes. (ContainerCreating, PodInitializing: just slow.)
STUCK_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff",
})  # fmt: skip
MAX_PROBLEM = 300
UNSCHEDULABLE = "Unschedulable"  # a pod's problem that is the cluster's room, not the pod's


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """Why this pod cannot run, when the reason will not clear by itself; None otherwise."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return f"{UNSCHEDULABLE}: {cond.get('message') or 'no node fits'}"
    containers = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for cs in containers:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in STUCK_REASONS:
            continue
        detail = waiting.get("message") or ""
        terminated = (cs.get("lastState") or {}).get("terminated") or {}
        if reason == "CrashLoopBackOff" and terminated:
            # The container's last log line (terminationMessagePolicy FallbackToLogsOnError).
            detail = (
                _last_line(terminated.get("message")) or f"exit code {terminated.get('exitCode')}"
            )
        return f"{reason}: {detail}"[:MAX_PROBLEM].rstrip(": ")
    return None


def pod_problems(pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Component -> why its pods cannot run (the first such pod by name), for the pools that
    have one."""
    out: dict[str, str] = {}
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        meta = pod.get("metadata") or {}
        component = pool_key(meta.get("labels"))
        if component is None or component in out or meta.get("deletionTimestamp"):
            continue
        if (problem := pod_problem(pod)) is not None:
            out[component] = problem
    return out


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Component -> pods the scheduler could not place (no node has room: e.g. no GPU left)."""
    out: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        component = pool_key(meta.get("labels"))
        if component is None or meta.get("deletionTimestamp"):
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                out[component] = out.get(component, 0) + 1
    return out


def pool_statuses(deployments: Iterable[Mapping[str, Any]]) -> dict[str, crd.PoolStatus]:
    """Component -> replicas, from Deployment objects (as returned by the API)."""
    out: dict[str, crd.PoolStatus] = {}
    for deployment in deployments:
        labels = deployment.get("metadata", {}).get("labels") or {}
        component = pool_key(labels)
        if component is None:
            continue
        spec_replicas = deployment.get("spec", {}).get("replicas", 0) or 0
        status = deployment.get("status") or {}
        out[component] = crd.PoolStatus(
            desired_replicas=spec_replicas,
            ready_replicas=status.get("readyReplicas", 0) or 0,
            revision=labels.get(builders.LABEL_REVISION),
        )
    return out


def _summary(pools: Mapping[str, crd.PoolStatus], components: Iterable[str]) -> str | None:
    present = [pools[c] for c in components if c in pools]
    if not present:
        return None
    return f"{sum(p.ready_replicas for p in present)}/{sum(p.desired_replicas for p in present)}"


def _condition(
    previous: Mapping[str, crd.Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    generation: int | None,
) -> crd.Condition:
    value = crd.ConditionStatus.true if status else crd.ConditionStatus.false
    old = previous.get(type_)
    changed = old is None or old.status != value
    return crd.Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=now() if changed or old is None else old.last_transition_time,
        observed_generation=generation,
    )


def _old_conditions(previous: Mapping[str, Any] | None) -> dict[str, crd.Condition]:
    return {
        c["type"]: crd.Condition.model_validate(c)
        for c in (previous or {}).get("conditions", [])
        if "type" in c
    }


def is_ready(status: crd.LLMServiceStatus) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def build_status(
    service: builders.Service,
    generation: int | None,
    deployments: Iterable[Mapping[str, Any]],
    previous: Mapping[str, Any] | None,
    pods: Iterable[Mapping[str, Any]] = (),
    scaling: autoscaling.ServiceAutoscaler | None = None,
) -> crd.LLMServiceStatus:
    """The whole status: pools, ready/desired summaries, conditions and endpoints. ``pods``
    (read only while some pool is not ready) name what keeps a pool from running;
    ``scaling`` adds the autoscaler's decisions and the MetricsAvailable condition."""
    old = _old_conditions(previous)
    pods = list(pods)
    problems = pod_problems(pods)
    # A pod the scheduler cannot place while another pod is still leaving (draining, on a
    # full node) waits for the room that pod holds: the normal course of a replacement.
    leaving = any((p.get("metadata") or {}).get("deletionTimestamp") for p in pods)
    deployments = list(deployments)
    pools = pool_statuses(deployments)
    if scaling is not None:
        for component, decision in scaling.decisions.items():
            if component in pools:
                pools[component] = pools[component].model_copy(
                    update={
                        **autoscaling.pool_fields(decision),
                        "capacity": scaling.capacity.get(component) or None,
                    }
                )
    pending = rollouts_pending(deployments)
    wanted = [
        f"{p.component}-{p.track}" if p.track else p.component for p in builders.pools(service)
    ]
    serving = [c for c in wanted if not c.endswith("-canary")]  # a canary's pools do not
    missing = [c for c in serving if c not in pools]  # make the service unready
    lagging = [
        (
            f"{c} {pools[c].ready_replicas}/{pools[c].desired_replicas}"
            if pools[c].ready_replicas < pools[c].desired_replicas
            else f"{c} rolling out ({pending[c]})"
        )
        + (f" ({problems[c]})" if c in problems else "")
        for c in serving
        if c in pools and (pools[c].ready_replicas < pools[c].desired_replicas or c in pending)
    ]
    failing = [
        f"{c}: {problems[c]}"
        for c in wanted
        if c in problems and not (leaving and problems[c].startswith(UNSCHEDULABLE))
    ]
    stable_revision = service.stable.model.revision
    stale = [
        c
        for c in wanted
        if c in pools and not c.endswith("-canary")
        and pools[c].revision not in (None, stable_revision)
    ]  # fmt: skip
    ready = not missing and not lagging
    waiting = "waiting for " + ", ".join([f"{c} missing" for c in missing] + lagging)
    ready_message = "all pools have their desired replicas ready" if ready else waiting
    progressing = bool(missing or lagging or stale)
    rolling = service.rollout is not None and service.rollout.phase in rollout.CANARY_PHASES
    conditions = [
        _condition(
            old,
            "Ready",
            ready,
            "AllPoolsReady" if ready else "PoolsNotReady",
            ready_message,
            generation,
        ),
        _condition(
            old,
            "Progressing",
            progressing or rolling,
            "RolloutInProgress" if rolling else ("Reconciling" if progressing else "Stable"),
            service.rollout.message
            if rolling and service.rollout is not None
            else (ready_message if progressing else "every pool matches the spec"),
            generation,
        ),
        _condition(
            old,
            "Degraded",
            bool(failing),
            "PodsFailing" if failing else "AsExpected",
            "; ".join(failing),
            generation,
        ),
    ]
    metrics = autoscaling.metrics_condition(scaling) if scaling is not None else None
    if metrics is not None:
        conditions.append(_condition(old, "MetricsAvailable", *metrics, generation))
    stable_pools = [c for c in pools if c != "gateway" and not c.endswith("-canary")]
    revisions = {pools[c].revision for c in stable_pools if pools[c].revision}
    rolled_out = not [c for c in stable_pools if c in pending]
    current = (
        stable_revision
        if revisions == {stable_revision} and rolled_out
        else (previous or {}).get("currentRevision")
    )
    return crd.LLMServiceStatus(
        observed_generation=generation,
        conditions=conditions,
        pools={c: pools[c] for c in wanted if c in pools},
        edge_replicas=_summary(pools, ["edge"]),
        cloud_replicas=_summary(pools, CLOUD_COMPONENTS),
        current_revision=current,
        autoscaling=autoscaling.summary(scaling) if scaling is not None else None,
        rollout=service.rollout,
        rollout_summary=rollout.summary(service.rollout),
        endpoints=builders.endpoints(service),
    )


def invalid_status(
    generation: int | None, previous: Mapping[str, Any] | None, message: str
) -> crd.LLMServiceStatus:
    """Status for a spec that can never work: Degraded with the reason, the rest kept as it was."""
    old = _old_conditions(previous)
    kept = crd.LLMServiceStatus.model_validate(
        {k: v for k, v in (previous or {}).items() if k not in ("conditions", "observedGeneration")}
    )
    kept.observed_generation = generation
    kept.conditions = [
        _condition(old, "Ready", False, "InvalidSpec", message, generation),
        _condition(
            old, "Progressing", False, "InvalidSpec", "fix the spec to continue", generation
        ),
        _condition(old, "Degraded", True, "InvalidSpec", message, generation),
    ]
    return kept
