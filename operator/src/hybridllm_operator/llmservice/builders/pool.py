"""The pools: one component's desired shape (:class:`Pool`: replicas, resources, image,
program and every flag), derived from the spec, for ``edge``, ``monolithic`` or
``prefill`` + ``decode``, and the ``gateway``; and which pool answers each tier.

The Deployments, Services and PodDisruptionBudgets are built from these, and local mode
(:mod:`hybridllm_operator.local.plan`) runs the same pools as processes. During a
rollout the new revision's pools (:data:`CANARY` track) are sized by their share of the
traffic; the stable pools keep their replicas, so an abort has somewhere to go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubernetes.utils.quantity import parse_quantity

from hybridllm_common import crd
from hybridllm_operator.llmservice.builders.common import (
    CANARY,
    KV_PORT,
    PORT,
    PROGRAMS,
    ROUTING_CONFIG_KEY,
    ROUTING_MOUNT,
    Service,
    kv_url,
)


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
