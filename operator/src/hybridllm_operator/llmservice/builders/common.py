"""What every child of an LLMService shares: the names, labels and owner reference of its
objects, the pod and container security settings, the ports and mounts, and
:class:`Service`, the parts of an LLMService the builders read.

:class:`Service` also says which spec the stable pools run and which the canary's, and
how many replicas each has, during a rollout (:mod:`hybridllm_operator.llmservice.rollout`).
Selectors carry only name, instance and component (plus the track for a canary), because
a Deployment's selector is immutable and the revision label changes on every rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hybridllm_common import crd
from hybridllm_forecaster import rollouts
from hybridllm_operator.llmservice import rollout as rollout_mod

MANAGED_BY = "hybridllm-operator"
PORT = 8000
KV_PORT = 8001  # prefill pool: KV transfer server (hybridllm_cloud.disagg)
GATEWAY_SERVICE_PORT = 80
GPU_RESOURCE = "nvidia.com/gpu"
ROUTING_CONFIG_KEY = "routing.json"
ROUTING_MOUNT = "/etc/hybridllm"
MODEL_CACHE_MOUNT = "/var/cache/hybridllm"
IMAGE_UID = 10001  # USER in docker/*.Dockerfile
SCRATCH_MOUNT = "/tmp"
# Every generated pod meets Pod Security "restricted" (a namespace that enforces it admits
# them: tests/hybridllm_operator/test_real_node.py serves from one). The images run as uid
# 10001; a claim's files become writable to it (the model store takes locks and writes
# conversions), checked at the root only once.
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": IMAGE_UID,
    "runAsGroup": IMAGE_UID,
    "fsGroup": IMAGE_UID,
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_REVISION = "hybridllm.io/revision"
LABEL_TRACK = "hybridllm.io/track"  # "canary" on the new revision's pools during a rollout
CANARY = "canary"

# The program each component runs: the ENTRYPOINT of its image in docker/, and the
# console script of its distribution that local mode starts.
PROGRAMS = {
    "edge": "hybridllm-edge",
    "monolithic": "hybridllm-cloud",
    "prefill": "hybridllm-cloud",
    "decode": "hybridllm-cloud",
    "gateway": "hybridllm-gateway",
}

# Flags that say where a process listens or finds its peers and files. They are the
# only ones a placement changes: a pod listens on PORT behind a Service, a local process
# on its own loopback port (local mode rewrites exactly these, nothing else).
ADDRESS_FLAGS = ("--host", "--port", "--kv-port", "--prefill-url", "--config", "--api-keys-file")


@dataclass(frozen=True)
class Images:
    """Container images per deployable distribution (operator settings, overridable per pool)."""

    edge: str = "hybridllm/runtime-edge:0.1.0"
    cloud: str = "hybridllm/runtime-cloud:0.1.0"
    gateway: str = "hybridllm/gateway:0.1.0"


class ServingDevice(NamedTuple):
    """An edge device of spec.edge.devices that serves: where and at which revision; over
    TLS, the name its certificate carries and its fleet's CA (``device_tls``)."""

    url: str
    revision: str
    server_name: str = ""
    ca: str = ""


@dataclass(frozen=True)
class Service:
    """The parts of an LLMService object the builders need."""

    name: str
    namespace: str
    uid: str
    spec: crd.LLMServiceSpec
    images: Images = field(default_factory=Images)
    # Replicas the autoscaler set, by component; a pool without one starts at the spec's.
    scaled: Mapping[str, int] = field(default_factory=dict)
    # The rollout's state (status.rollout): the stable pools' spec, the canary's weight.
    rollout: crd.RolloutStatus | None = None
    # Serving edge devices of spec.edge.devices.
    devices: tuple[ServingDevice, ...] = ()
    # The autoscaler's forecast need of each pool over its lead time and the rollout
    # step's pause (replicas at the target utilisation): the canary's surge.
    forecast: Mapping[str, float] = field(default_factory=dict)

    def replicas(self, component: str, pool: crd.PoolSpec) -> int | None:
        """A scaled pool's replicas: the autoscaler's, the spec's until it has decided, or
        None when an external autoscaler (an HPA, KEDA) owns them."""
        if self.spec.autoscaling.mode == crd.AutoscalingMode.external:
            return None
        if self.spec.autoscaling.mode in crd.SCALING_MODES and component in self.scaled:
            return self.scaled[component]
        return pool.replicas

    def autoscaled(self) -> bool:
        mode = self.spec.autoscaling.mode
        return mode in crd.SCALING_MODES or mode == crd.AutoscalingMode.external

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.name

    @property
    def revision(self) -> str:
        return self.spec.model.revision

    @property
    def stable(self) -> crd.LLMServiceSpec:
        """The spec the stable pools run: the live one, unless a rollout recorded another
        (while it has a canary, while a new revision waits for its window, and once it
        aborted: the spec's revision is not served until it is set back or retried)."""
        if self.rollout is None or not (
            rollout_mod.has_canary(self.rollout)
            or self.rollout.phase in (crd.RolloutPhase.aborted, crd.RolloutPhase.scheduled)
        ):
            return self.spec
        return rollout_mod.stable_spec(self.rollout, self.spec)

    @property
    def canary(self) -> crd.LLMServiceSpec | None:
        """The spec the canary pools run while a rollout has them (the stable one once the
        stable pools have taken it over)."""
        if not rollout_mod.has_canary(self.rollout):
            return None
        assert self.rollout is not None
        if self.rollout.phase in (crd.RolloutPhase.promoting, crd.RolloutPhase.finalizing):
            return self.stable
        return self.spec

    def canary_replicas(self, component: str, pool: crd.PoolSpec) -> int | None:
        """The canary's share of a pool (`rollouts.canary_size`): the traffic share of the
        step it is at or heading for, of the replicas the pool has now or the forecast
        asks for over the step, whichever is more."""
        total = self.replicas(component, pool)
        if total is None or self.rollout is None:
            return total
        tier = "edge" if component == "edge" else "cloud"
        weight = rollout_mod.sizing_weight(self.rollout, self.spec, tier)
        forecast = self.forecast.get(component)
        return int(rollouts.canary_size(total, forecast, pool.max_replicas, weight))


def child_name(service: Service, component: str, track: str | None = None) -> str:
    return f"{service.name}-{component}" + (f"-{track}" if track else "")


def routing_configmap_name(service: Service) -> str:
    return f"{service.name}-routing"


def selector_labels(service: Service, component: str, track: str | None = None) -> dict[str, str]:
    out = {LABEL_NAME: "hybridllm", LABEL_INSTANCE: service.name, LABEL_COMPONENT: component}
    return out | ({LABEL_TRACK: track} if track else {})


def labels(
    service: Service,
    component: str,
    *,
    revisioned: bool = True,
    revision: str | None = None,
    track: str | None = None,
) -> dict[str, str]:
    out = {**selector_labels(service, component, track), LABEL_MANAGED_BY: MANAGED_BY}
    if revisioned:
        out[LABEL_REVISION] = revision or service.revision
    return out


def is_canary(obj_labels: Mapping[str, str] | None) -> bool:
    """Whether a child (by its labels) belongs to a rollout's canary pools."""
    return (obj_labels or {}).get(LABEL_TRACK) == CANARY


def owner_reference(service: Service) -> dict[str, Any]:
    return {
        "apiVersion": crd.API_VERSION,
        "kind": "LLMService",
        "name": service.name,
        "uid": service.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(
    service: Service,
    name: str,
    component: str,
    *,
    revisioned: bool = True,
    revision: str | None = None,
    track: str | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": service.namespace,
        "labels": labels(service, component, revisioned=revisioned, revision=revision, track=track),
        "ownerReferences": [owner_reference(service)],
    }


def service_url(service: Service, component: str, track: str | None = None) -> str:
    port = GATEWAY_SERVICE_PORT if component == "gateway" else PORT
    return f"http://{child_name(service, component, track)}.{service.namespace}.svc:{port}"


def kv_url(service: Service, track: str | None = None) -> str:
    """The prefill pool's KV endpoint; its Service is headless, so the name resolves to
    every prefill pod and the decode workers balance and fail over between them. A
    canary's decode pool asks the canary's prefill pool (the KV layout is the model's)."""
    name = child_name(service, "prefill", track)
    return f"tcp://{name}.{service.namespace}.svc:{KV_PORT}"
