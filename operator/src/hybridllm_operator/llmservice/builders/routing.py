"""The gateway's routing table (tiers, their backends, the routing policy and limits) and
the ConfigMap that carries it to the gateway pods.

During a rollout each tier has the stable and the canary Service, and the table gives
each revision its weight. Local mode writes the same table (:func:`routing_config`) with
one backend per ready replica instead of one Service URL per tier.
"""

from __future__ import annotations

import json
from typing import Any

from hybridllm_common import routing
from hybridllm_operator.llmservice import rollout as rollout_mod
from hybridllm_operator.llmservice.builders.common import (
    CANARY,
    ROUTING_CONFIG_KEY,
    Service,
    metadata,
    routing_configmap_name,
    service_url,
)
from hybridllm_operator.llmservice.builders.pool import scales_from_zero, tier_components


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
    tiers: dict[str, routing.Tier] = {}
    device_tier = {"edge"} if service.devices and service.stable.edge.enabled else set()
    for tier in sorted(set(backends) | set(canary or {}) | device_tier):
        weight = rollout_mod.canary_weight(service.rollout, tier)
        rows = [
            routing.Backend(url=u, revision=stable_revision, weight=100 - weight)
            for u in backends.get(tier, [])
        ]
        rows += [
            routing.Backend(url=u, revision=canary_revision, weight=weight)
            for u in (canary or {}).get(tier, [])
        ]
        if tier == "edge":  # devices: at their revision's weight (a rollout's, or the rest)
            rows += [
                routing.Backend(
                    url=d.url,
                    revision=d.revision,
                    weight=weight if d.revision == canary_revision else 100 - weight,
                    device=True,  # never sent the backend token
                    server_name=d.server_name,  # its certificate's name, verified
                )
                for d in service.devices
            ]
        if rows:  # in the cluster: no WAN between the gateway and the pools (not remote)
            tiers[tier] = routing.Tier(
                backends=rows, scale_from_zero=scales_from_zero(service, tier)
            )
    objective = spec.routing.objective
    # built, not validated: a table with no backend yet (devices still to come) is written
    # all the same, and a gateway keeps its last good one until one has backends
    table = routing.RoutingConfig.model_construct(
        service=service.name,
        namespace=service.namespace,
        model=service.served_name,
        revision=stable_revision,
        generation=service.rollout.routing_generation if service.rollout else 0,
        policy=spec.routing.policy,
        edge_limits=routing.lenient(routing.EdgeLimits, spec.routing.edge_limits),
        session_affinity=routing.lenient(routing.SessionAffinity, spec.routing.session_affinity),
        cascade=routing.lenient(routing.Cascade, spec.routing.cascade),
        balance=routing.lenient(routing.Balance, spec.routing.balance),
        objective=routing.lenient(routing.Objective, objective) if objective else None,
        slo_ttft_seconds=spec.slo.ttft_p95_seconds,
        rate_limits=routing.RateLimits(
            requests_per_minute=spec.gateway.requests_per_minute,
            tokens_per_minute=spec.gateway.tokens_per_minute,
        ),
        golden_prompts=[
            routing.lenient(routing.GoldenPrompt, p) for p in spec.rollout.analysis.golden_prompts
        ],
        tiers=tiers,
        device_ca=next((d.ca for d in service.devices if d.ca), ""),
    )
    return table.to_wire()


def build_routing_configmap(service: Service) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(service, routing_configmap_name(service), "gateway", revisioned=False),
        "data": {
            ROUTING_CONFIG_KEY: json.dumps(build_routing_config(service), indent=2, sort_keys=True)
        },
    }
