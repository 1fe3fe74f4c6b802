"""Each pool's Deployment: its container (program, flags, ports, probes, resources, the
model cache and scratch volumes, the gateway's routing table and API keys), the pod's
security settings and how a rollout replaces its pods."""

from __future__ import annotations

from typing import Any

from hybridllm_common import crd, termination
from hybridllm_operator import isolation
from hybridllm_operator.llmservice.builders.common import (
    CONTAINER_SECURITY,
    GPU_RESOURCE,
    KV_PORT,
    MODEL_CACHE_MOUNT,
    POD_SECURITY,
    PORT,
    ROUTING_MOUNT,
    SCRATCH_MOUNT,
    Service,
    child_name,
    labels,
    metadata,
    routing_configmap_name,
    selector_labels,
)
from hybridllm_operator.llmservice.builders.pool import Pool


def _resources(resources: crd.Resources) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": resources.cpu, "memory": resources.memory}
    limits = dict(amounts)
    if resources.gpu:
        limits[GPU_RESOURCE] = resources.gpu
    return {"requests": amounts, "limits": limits}


def ready_path(component: str) -> str:
    """The HTTP path that says a pool's server is ready to take requests."""
    return "/readyz" if component == "gateway" else "/health"


def liveness_probe(component: str) -> dict[str, Any]:
    """A gateway is alive while its event loop answers: /readyz is served by the loop
    itself, so a loop stalled by one request (a runaway parse) fails the probe within
    30 s and the pod restarts; an open port alone would keep a hung gateway forever. A
    runtime's loop waits on its model while loading (minutes), so an open port it is."""
    if component == "gateway":
        return {
            "httpGet": {"path": "/readyz", "port": "http"},
            "timeoutSeconds": 2,
            "periodSeconds": 10,
            "failureThreshold": 3,
        }
    return {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6}


def build_deployment(service: Service, pool: Pool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "server",
        "image": pool.image,
        "command": [pool.program],
        "args": pool.args,
        "ports": [
            {"name": "http", "containerPort": PORT, "protocol": "TCP"},
            *(
                [{"name": "kv", "containerPort": KV_PORT, "protocol": "TCP"}]
                if pool.component == "prefill"
                else []
            ),
        ],
        "env": [
            {"name": "HYBRIDLLM_MODEL_CACHE", "value": MODEL_CACHE_MOUNT},
            # A claim filled beforehand: a missing model is an error saying so, not a fetch.
            *(
                [{"name": "HYBRIDLLM_MODEL_OFFLINE", "value": "1"}]
                if service.spec.model.cache is not None
                else []
            ),
            *({"name": k, "value": v} for k, v in sorted(pool.env.items())),
            # the gateway sends it, the runtimes ask for it (isolation.py)
            isolation.token_env(service.name),
            # the root filesystem is read-only: whatever a library caches under ~ goes to
            # the pod's scratch /tmp
            {"name": "HOME", "value": SCRATCH_MOUNT},
        ],
        "resources": _resources(pool.resources),
        # Leaving (a scale-down, a rollout, a drain): the pod is taken out of its Service's
        # endpoints while this sleep runs, so no new request reaches it; then SIGTERM, and
        # the server finishes what it is answering before it exits.
        "lifecycle": {"preStop": {"sleep": {"seconds": termination.DRAIN_DELAY_SECONDS}}},
        # A container that exits with an error leaves its last log lines as its termination
        # message: the status names the cause (a missing model, a bad flag) from there.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # A runtime's /health is 503 until the model is loaded: readiness, not liveness,
        # waits for it. A gateway is ready once it listens (/readyz): with no healthy
        # backend it still answers (503 and Retry-After, or a hold for scale from zero)
        # and reports the demand the autoscaler reads.
        "readinessProbe": {
            "httpGet": {"path": ready_path(pool.component), "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": liveness_probe(pool.component),
        "volumeMounts": [
            {"name": "model-cache", "mountPath": MODEL_CACHE_MOUNT},
            {"name": "scratch", "mountPath": SCRATCH_MOUNT},
        ],
        "securityContext": CONTAINER_SECURITY,
    }
    cache = service.spec.model.cache
    volumes: list[dict[str, Any]] = [
        # A claim already holding the model (verified by sha256 at load), or a scratch
        # directory the runtime fetches the model into when it starts.
        {
            "name": "model-cache",
            "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim},
        }
        if cache is not None
        else {"name": "model-cache", "emptyDir": {}},
        {"name": "scratch", "emptyDir": {}},
    ]
    if pool.component == "gateway":
        container["volumeMounts"].append(
            {"name": "routing", "mountPath": ROUTING_MOUNT, "readOnly": True}
        )
        volumes.append({"name": "routing", "configMap": {"name": routing_configmap_name(service)}})
        if service.spec.gateway.api_keys_secret:
            container["volumeMounts"].append(
                {"name": "api-keys", "mountPath": "/etc/hybridllm-keys", "readOnly": True}
            )
            volumes.append(
                {"name": "api-keys", "secret": {"secretName": service.spec.gateway.api_keys_secret}}
            )
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        # the preStop delay plus the longest request the gateway lets run: nothing in
        # flight is cut off (a replica that has drained exits at once)
        "terminationGracePeriodSeconds": termination.TERMINATION_GRACE_SECONDS,
        "securityContext": POD_SECURITY,
        # no pod of a service talks to the API server
        "automountServiceAccountToken": False,
    }
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.resources.gpu:
        pod_spec["tolerations"] = [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
    pod_labels = labels(
        service, pool.component, revisioned=pool.revisioned, revision=pool.revision,
        track=pool.track,
    )  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **metadata(service, child_name(service, pool.component, pool.track), pool.component),
            "labels": pod_labels,
        },
        "spec": {
            **({"replicas": pool.replicas} if pool.replicas is not None else {}),
            "selector": {"matchLabels": selector_labels(service, pool.component, pool.track)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": _rolling_update(service, pool)},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def _rolling_update(service: Service, pool: Pool) -> dict[str, Any]:
    """How a pool's Deployment replaces its pods: one new replica ready before an old one
    goes (a spec change never takes serving capacity). While a rollout promotes, the
    canary serves all traffic and the stable pools none: they take the new revision all
    at once, in one cold start instead of one per replica (a hundred-replica pool would
    otherwise run its full-size canary beside it for a hundred cold starts)."""
    promoting = (
        service.rollout is not None
        and service.rollout.phase == crd.RolloutPhase.promoting
        and pool.track is None
        and pool.revisioned
    )
    if promoting:
        return {"maxUnavailable": "100%", "maxSurge": 0}
    return {"maxUnavailable": 0, "maxSurge": 1}
