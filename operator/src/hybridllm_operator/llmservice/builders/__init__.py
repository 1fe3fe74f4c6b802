"""Pure builders: an LLMService in, the Kubernetes objects it should own out.

Nothing here talks to the API server, so every manifest is testable without a cluster
and the reconciler is "compute desired objects, apply them, delete the rest". One
component is one pool: ``edge``, ``monolithic`` or ``prefill`` + ``decode``, and the
``gateway``. Each gets a Deployment and a Service (and a PodDisruptionBudget when it
has two or more replicas); the gateway also gets the ConfigMap with its routing table.
Selectors carry only name, instance and component, because a Deployment's selector is
immutable and the revision label changes on every rollout.

During a rollout (:mod:`hybridllm_operator.llmservice.rollout`) the new revision's pools run beside
the stable ones as ``<name>-<component>-canary``, labelled ``hybridllm.io/track:
canary`` and selected by it; the stable pools keep their names and run the spec recorded
in the rollout's status. The stable pools' Services then also select the stable
revision, so neither Service reaches the other revision's pods, and the gateway's table
gives each revision a weight. The canary is sized by its share of the traffic; the
stable pools keep their replicas, so an abort has somewhere to go.

Where each part lives:

- :mod:`~hybridllm_operator.llmservice.builders.common`: :class:`Service` (the parts of an
  LLMService the builders read, and which spec the stable and canary pools run), the
  labels, names, metadata and owner reference of every child, the ports and mounts, and
  the pod and container security settings (``POD_SECURITY``, ``CONTAINER_SECURITY``);
- :mod:`~hybridllm_operator.llmservice.builders.pool`: :class:`Pool`, one component's desired shape
  (replicas, image, program and flags), the pools of a revision and the gateway's, and
  which pool answers each tier;
- :mod:`~hybridllm_operator.llmservice.builders.deployments`: each pool's Deployment;
- :mod:`~hybridllm_operator.llmservice.builders.services`: each pool's Service, and the endpoints
  the status shows;
- :mod:`~hybridllm_operator.llmservice.builders.routing`: the gateway's routing table and its
  ConfigMap;
- :mod:`~hybridllm_operator.llmservice.builders.policies`: the PodDisruptionBudgets, the runtime
  pods' NetworkPolicy and the backend token's Secret.

:func:`build_children` (here) puts them together. Every name is re-exported here:
``from hybridllm_operator.llmservice import builders`` and ``builders.NAME``.
"""

from __future__ import annotations

from typing import Any

from hybridllm_operator.llmservice.builders.common import (
    ADDRESS_FLAGS,
    CANARY,
    CONTAINER_SECURITY,
    GATEWAY_SERVICE_PORT,
    GPU_RESOURCE,
    IMAGE_UID,
    KV_PORT,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REVISION,
    LABEL_TRACK,
    MANAGED_BY,
    MODEL_CACHE_MOUNT,
    POD_SECURITY,
    PORT,
    PROGRAMS,
    ROUTING_CONFIG_KEY,
    ROUTING_MOUNT,
    SCRATCH_MOUNT,
    Images,
    Service,
    ServingDevice,
    child_name,
    is_canary,
    kv_url,
    labels,
    metadata,
    owner_reference,
    routing_configmap_name,
    selector_labels,
    service_url,
)
from hybridllm_operator.llmservice.builders.deployments import (
    build_deployment,
    liveness_probe,
    ready_path,
)
from hybridllm_operator.llmservice.builders.policies import (
    build_network_policy,
    build_pdb,
    build_token_secret,
)
from hybridllm_operator.llmservice.builders.pool import (
    Pool,
    cpu_threads,
    model_pools,
    pools,
    scales_from_zero,
    tier_components,
)
from hybridllm_operator.llmservice.builders.routing import (
    build_routing_config,
    build_routing_configmap,
    routing_config,
)
from hybridllm_operator.llmservice.builders.services import build_service, endpoints

__all__ = [
    "ADDRESS_FLAGS",
    "CANARY",
    "CONTAINER_SECURITY",
    "GATEWAY_SERVICE_PORT",
    "GPU_RESOURCE",
    "IMAGE_UID",
    "KV_PORT",
    "LABEL_COMPONENT",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "LABEL_REVISION",
    "LABEL_TRACK",
    "MANAGED_BY",
    "MODEL_CACHE_MOUNT",
    "POD_SECURITY",
    "PORT",
    "PROGRAMS",
    "ROUTING_CONFIG_KEY",
    "ROUTING_MOUNT",
    "SCRATCH_MOUNT",
    "Images",
    "Pool",
    "Service",
    "ServingDevice",
    "build_children",
    "build_deployment",
    "build_network_policy",
    "build_pdb",
    "build_routing_config",
    "build_routing_configmap",
    "build_service",
    "build_token_secret",
    "child_name",
    "cpu_threads",
    "endpoints",
    "is_canary",
    "kv_url",
    "labels",
    "liveness_probe",
    "metadata",
    "model_pools",
    "owner_reference",
    "pools",
    "ready_path",
    "routing_config",
    "routing_configmap_name",
    "scales_from_zero",
    "selector_labels",
    "service_url",
    "tier_components",
]


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
