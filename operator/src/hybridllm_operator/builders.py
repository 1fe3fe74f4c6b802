"""Pure builders: an LLMService in, the Kubernetes objects it should own out.

Nothing here talks to the API server, so every manifest is testable without a cluster
and the reconciler is "compute desired objects, apply them, delete the rest". One
component is one pool: ``edge``, ``monolithic`` or ``prefill`` + ``decode``, and the
``gateway``. Each gets a Deployment and a Service (and a PodDisruptionBudget when it
has two or more replicas); the gateway also gets the ConfigMap with its routing table.
Selectors carry only name, instance and component, because a Deployment's selector is
immutable and the revision label changes on every rollout.

During a rollout (:mod:`hybridllm_operator.rollout`) the new revision's pools run beside
the stable ones as ``<name>-<component>-canary``, labelled ``hybridllm.io/track:
canary`` and selected by it; the stable pools keep their names and run the spec recorded
in the rollout's status. The stable pools' Services then also select the stable
revision, so neither Service reaches the other revision's pods, and the gateway's table
gives each revision a weight. The canary is sized by its share of the traffic; the
stable pools keep their replicas, so an abort has somewhere to go.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from hybridllm_common import crd, termination
from hybridllm_forecaster import rollouts
from hybridllm_operator import isolation
from hybridllm_operator import rollout as rollout_mod

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
    # Serving edge devices of spec.edge.devices (their URL and the revision they run).
    devices: tuple[tuple[str, str], ...] = ()
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


def _metadata(
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


# --------------------------------------------------------------------------- pools


@dataclass(frozen=True)
class Pool:
    """One component's desired shape, derived from the spec."""

    component: str
    replicas: int | None  # None: an external autoscaler owns them
    resources: crd.Resources
    image: str
    args: list[str]
    program: str
    node_selector: dict[str, str] | None = None
    revisioned: bool = True
    env: dict[str, str] = field(default_factory=dict)
    max_replicas: int | None = None  # the autoscaler's bound (None: not autoscaled)
    revision: str | None = None  # the model revision its pods run (None: the spec's)
    track: str | None = None  # "canary" for a rollout's new revision, else None


def cpu_threads(resources: crd.Resources) -> int:
    """Threads for a replica's compute: its CPU quantity rounded down, at least one.

    Left to themselves llama.cpp and torch size their thread pools to the node's cores,
    not to the pod's CPU limit, and a 2-CPU pod on a 64-core node then spends its time
    throttled by the CFS quota.
    """
    return max(1, int(parse_quantity(resources.cpu)))  # type: ignore[no-untyped-call]


def _model_args(service: Service, spec: crd.LLMServiceSpec) -> list[str]:
    # A runtime that cannot load its model exits with the reason as its termination
    # message, which the status then shows (see status.pod_problem).
    args = ["--model", spec.model.source, "--served-model-name", service.served_name]
    args += ["--exit-on-load-error"]
    if spec.model.sha256 is not None:
        args += ["--model-sha256", spec.model.sha256]
    if spec.model.context_length is not None:
        args += ["--max-model-len", str(spec.model.context_length)]
    return args


def _edge_pool(service: Service, spec: crd.LLMServiceSpec, track: str | None = None) -> Pool:
    edge = spec.edge
    args = ["serve", *_model_args(service, spec), "--backend", edge.runtime.value]
    args += [
        "--quantization",
        edge.quantization.value,
        "--parallel",
        str(edge.parallel),
        "--threads",
        str(cpu_threads(edge.pool.resources)),
        "--port",
        str(PORT),
    ]
    if edge.response_cache.enabled:
        args += [
            "--cache-ttl-seconds",
            str(edge.response_cache.ttl_seconds),
            "--cache-max-entries",
            str(edge.response_cache.max_entries),
        ]
    else:
        args += ["--no-cache"]
    return Pool(
        component="edge",
        replicas=(service.canary_replicas if track else service.replicas)("edge", edge.pool),
        max_replicas=edge.pool.max_replicas if service.autoscaled() else None,
        resources=edge.pool.resources,
        image=edge.pool.image or service.images.edge,
        args=args,
        program=PROGRAMS["edge"],
        node_selector=edge.pool.node_selector,
        revision=spec.model.revision,
        track=track,
    )


def _cloud_pool(
    service: Service,
    spec: crd.LLMServiceSpec,
    role: str,
    pool: crd.PoolSpec,
    track: str | None = None,
) -> Pool:
    cloud = spec.cloud
    args = ["serve", *_model_args(service, spec), "--role", role, "--port", str(PORT)]
    args += ["--dtype", cloud.dtype.value, "--quantization", cloud.quantization.value]
    args += [
        "--block-size",
        str(cloud.kv_cache.block_size),
        "--max-num-seqs",
        str(cloud.max_num_seqs),
    ]
    args += ["--gpu-memory-fraction", str(cloud.kv_cache.gpu_memory_fraction)]
    args += ["--torch-threads", str(cpu_threads(pool.resources))]
    if pool.resources.gpu:
        args += ["--device", "cuda"]
    if not cloud.kv_cache.prefix_caching:
        args += ["--no-enable-prefix-caching"]
    if role == "prefill":
        args += ["--kv-port", str(KV_PORT)]
    if role == "decode":
        args += [
            "--prefill-url",
            kv_url(service, track),
            "--local-prefill-threshold",
            str(cloud.local_prefill_threshold),
        ]
    return Pool(
        component=role,
        replicas=(service.canary_replicas if track else service.replicas)(role, pool),
        max_replicas=pool.max_replicas if service.autoscaled() else None,
        resources=pool.resources,
        image=pool.image or service.images.cloud,
        args=args,
        program=PROGRAMS[role],
        node_selector=pool.node_selector,
        revision=spec.model.revision,
        track=track,
    )


def _gateway_pool(service: Service) -> Pool:
    gateway = service.spec.gateway
    args = ["serve", "--config", f"{ROUTING_MOUNT}/{ROUTING_CONFIG_KEY}", "--port", str(PORT)]
    if any(scales_from_zero(service, t) for t in tier_components(service)):
        # a request for a tier at zero waits for a replica: its start plus the autoscaler's
        # reaction (a metrics window and an interval or two)
        scaling = service.spec.autoscaling
        wait = scaling.scale_up_lead_seconds + 2 * scaling.interval_seconds + 60
        args += ["--hold-timeout-s", str(wait)]
    if gateway.api_keys_secret:
        args += ["--api-keys-file", "/etc/hybridllm-keys/keys"]
    return Pool(
        component="gateway",
        replicas=gateway.replicas,
        resources=gateway.resources,
        image=gateway.image or service.images.gateway,
        args=args,
        program=PROGRAMS["gateway"],
        revisioned=False,
    )


def model_pools(service: Service, spec: crd.LLMServiceSpec, track: str | None = None) -> list[Pool]:
    """The pools that serve the model as ``spec`` says (one revision's), in a stable order."""
    out: list[Pool] = []
    if spec.edge.enabled:
        out.append(_edge_pool(service, spec, track))
    if spec.cloud.enabled:
        if spec.cloud.mode == crd.CloudMode.disaggregated:
            assert spec.cloud.prefill is not None
            assert spec.cloud.decode is not None
            out.append(_cloud_pool(service, spec, "prefill", spec.cloud.prefill, track))
            out.append(_cloud_pool(service, spec, "decode", spec.cloud.decode, track))
        else:
            out.append(_cloud_pool(service, spec, "monolithic", spec.cloud.monolithic, track))
    return out


def pools(service: Service) -> list[Pool]:
    """Every pool: the stable revision's, the gateway, then a rollout's canary pools."""
    out = [*model_pools(service, service.stable), _gateway_pool(service)]
    canary = service.canary
    if canary is not None:
        out += model_pools(service, canary, CANARY)
    return out


# --------------------------------------------------------------------------- objects


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
            **_metadata(service, child_name(service, pool.component, pool.track), pool.component),
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


def build_service(service: Service, pool: Pool) -> dict[str, Any]:
    port = GATEWAY_SERVICE_PORT if pool.component == "gateway" else PORT
    selector = selector_labels(service, pool.component, pool.track)
    if pool.track is None and pool.revisioned and service.canary is not None:
        # a rollout: the stable pool's Service must not reach the canary's pods
        selector[LABEL_REVISION] = pool.revision or service.revision
    spec: dict[str, Any] = {
        "type": "ClusterIP",
        "selector": selector,
        "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
    }
    if pool.component == "prefill":
        # Headless: decode workers resolve the name to every ready prefill pod.
        spec["clusterIP"] = "None"
        spec["ports"].append({"name": "kv", "port": KV_PORT, "targetPort": "kv", "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            service,
            child_name(service, pool.component, pool.track),
            pool.component,
            revisioned=False,
            track=pool.track,
        ),
        "spec": spec,
    }


def build_pdb(service: Service, pool: Pool) -> dict[str, Any] | None:
    """At most one replica of a pool down for voluntary disruptions; none for a pool that
    never has more than one replica (an autoscaled pool: its maximum)."""
    most = pool.max_replicas if pool.max_replicas is not None else pool.replicas
    if most is None or most < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(
            service,
            child_name(service, pool.component, pool.track),
            pool.component,
            revisioned=False,
            track=pool.track,
        ),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(service, pool.component, pool.track)},
        },
    }


def tier_components(service: Service, spec: crd.LLMServiceSpec | None = None) -> dict[str, str]:
    """The pool that answers each enabled tier: the gateway sends cloud requests to the
    decode pool (which asks the prefill pool itself) or to the monolithic pool."""
    spec = spec or service.stable
    out = {}
    if spec.edge.enabled:
        out["edge"] = "edge"
    if spec.cloud.enabled:
        out["cloud"] = "decode" if spec.cloud.mode == crd.CloudMode.disaggregated else "monolithic"
    return out


def scales_from_zero(service: Service, tier: str) -> bool:
    """Whether the autoscaler may take every pool of a tier to zero replicas (the gateway
    then holds the tier's requests while it brings one back)."""
    if service.spec.autoscaling.mode not in crd.SCALING_MODES:
        return False
    pools = [
        p for c, p in crd.scaled_pools(service.spec).items() if (c == "edge") == (tier == "edge")
    ]
    return bool(pools) and all(p.min_replicas == 0 for p in pools)


def build_routing_config(service: Service) -> dict[str, Any]:
    """The gateway's routing table: tiers, their backends and the routing policy; during a
    rollout each tier has the stable and the canary Service, weighted."""
    stable = {t: [service_url(service, c)] for t, c in tier_components(service).items()}
    edge_pool = service.stable.edge.pool
    if (
        service.devices
        and "edge" in stable
        and service.replicas("edge", edge_pool) == 0
        and not scales_from_zero(service, "edge")
    ):
        del stable["edge"]  # no pod will ever answer: the devices serve the tier alone
    canary_spec = service.canary
    canary = (
        {
            t: [service_url(service, c, CANARY)]
            for t, c in tier_components(service, canary_spec).items()
        }
        if canary_spec is not None
        else {}
    )
    return routing_config(service, stable, canary)


def routing_config(
    service: Service, backends: dict[str, list[str]], canary: dict[str, list[str]] | None = None
) -> dict[str, Any]:
    """The routing table with the given backend URLs per tier (a tier with none is left
    out): one Service URL per tier in a cluster, one URL per ready replica locally; and a
    rollout's canary URLs, at the canary's weight."""
    spec = service.spec
    stable_revision = service.stable.model.revision
    canary_revision = service.canary.model.revision if service.canary is not None else ""
    tiers: dict[str, Any] = {}
    device_tier = {"edge"} if service.devices and service.stable.edge.enabled else set()
    for tier in sorted(set(backends) | set(canary or {}) | device_tier):
        weight = rollout_mod.canary_weight(service.rollout, tier)
        rows = [
            {"url": u, "revision": stable_revision, "weight": 100 - weight, "device": False}
            for u in backends.get(tier, [])
        ]
        rows += [
            {"url": u, "revision": canary_revision, "weight": weight, "device": False}
            for u in (canary or {}).get(tier, [])
        ]
        if tier == "edge":  # devices: at their revision's weight (a rollout's, or the rest)
            rows += [
                {
                    "url": u,
                    "revision": rev,
                    "weight": weight if rev == canary_revision else 100 - weight,
                    "device": True,  # never sent the backend token
                }
                for u, rev in service.devices
            ]
        if rows:
            tiers[tier] = {"backends": rows, "scaleFromZero": scales_from_zero(service, tier)}
    return {
        "service": service.name,
        "namespace": service.namespace,
        "model": service.served_name,
        "revision": stable_revision,
        "generation": service.rollout.routing_generation if service.rollout else 0,
        "policy": spec.routing.policy.value,
        "edgeLimits": spec.routing.edge_limits.to_wire(),
        "sessionAffinity": spec.routing.session_affinity.to_wire(),
        "cascade": spec.routing.cascade.to_wire(),
        "balance": spec.routing.balance.to_wire(),
        "rateLimits": {
            "requestsPerMinute": spec.gateway.requests_per_minute,
            "tokensPerMinute": spec.gateway.tokens_per_minute,
        },
        # asked of the canary's backends by the gateways (the rollout waits for them)
        "goldenPrompts": [p.to_wire() for p in spec.rollout.analysis.golden_prompts],
        "tiers": tiers,
    }


def build_routing_configmap(service: Service) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            service, routing_configmap_name(service), "gateway", revisioned=False
        ),
        "data": {
            ROUTING_CONFIG_KEY: json.dumps(build_routing_config(service), indent=2, sort_keys=True)
        },
    }


def build_children(service: Service) -> list[dict[str, Any]]:
    """Every object the LLMService owns, ConfigMap first so the gateway finds it at start."""
    objects: list[dict[str, Any]] = [build_routing_configmap(service)]
    for pool in pools(service):
        objects.append(build_deployment(service, pool))
        objects.append(build_service(service, pool))
        pdb = build_pdb(service, pool)
        if pdb is not None:
            objects.append(pdb)
    objects.append(build_network_policy(service))
    return objects


def build_network_policy(service: Service) -> dict[str, Any]:
    """The runtime pods' ingress: the gateway, the metrics scrapers, decode -> prefill KV."""
    meta = _metadata(service, f"{service.name}-runtimes", "runtimes", revisioned=False)
    return isolation.build_network_policy(
        meta, lambda component: selector_labels(service, component), LABEL_COMPONENT, PORT, KV_PORT
    )


def build_token_secret(service: Service) -> dict[str, Any]:
    """The backend token's Secret, with a new token: created once (reconcile.py)."""
    name = isolation.token_secret_name(service.name)
    return isolation.build_token_secret(_metadata(service, name, "gateway", revisioned=False))


def endpoints(service: Service) -> crd.Endpoints:
    urls = {tier: service_url(service, c) for tier, c in tier_components(service).items()}
    return crd.Endpoints(
        gateway=service_url(service, "gateway"), edge=urls.get("edge"), cloud=urls.get("cloud")
    )
