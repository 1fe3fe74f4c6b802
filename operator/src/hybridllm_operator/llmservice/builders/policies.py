"""What limits disruption and access: each pool's PodDisruptionBudget, the runtime pods'
NetworkPolicy and the backend token's Secret (the last two from
:mod:`hybridllm_operator.isolation`)."""

from __future__ import annotations

from typing import Any

from hybridllm_operator import isolation
from hybridllm_operator.llmservice.builders.common import (
    KV_PORT,
    LABEL_COMPONENT,
    PORT,
    Service,
    child_name,
    metadata,
    selector_labels,
)
from hybridllm_operator.llmservice.builders.pool import Pool


def build_pdb(service: Service, pool: Pool) -> dict[str, Any] | None:
    """At most one replica of a pool down for voluntary disruptions; none for a pool that
    never has more than one replica (an autoscaled pool: its maximum)."""
    most = pool.max_replicas if pool.max_replicas is not None else pool.replicas
    if most is None or most < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(
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


def build_network_policy(service: Service) -> dict[str, Any]:
    """The runtime pods' ingress: the gateway, the metrics scrapers, decode -> prefill KV."""
    meta = metadata(service, f"{service.name}-runtimes", "runtimes", revisioned=False)
    return isolation.build_network_policy(
        meta, lambda component: selector_labels(service, component), LABEL_COMPONENT, PORT, KV_PORT
    )


def build_token_secret(service: Service) -> dict[str, Any]:
    """The backend token's Secret, with a new token: created once (reconcile.py)."""
    name = isolation.token_secret_name(service.name)
    return isolation.build_token_secret(metadata(service, name, "gateway", revisioned=False))
