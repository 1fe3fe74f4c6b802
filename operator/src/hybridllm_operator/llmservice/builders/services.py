"""Each pool's Service (the prefill pool's headless, so decode workers reach every
prefill pod), and the service's endpoints as its status shows them.

During a rollout the stable pools' Services also select the stable revision, so neither
Service reaches the other revision's pods.
"""

from __future__ import annotations

from typing import Any

from hybridllm_common import crd
from hybridllm_operator.llmservice.builders.common import (
    GATEWAY_SERVICE_PORT,
    KV_PORT,
    LABEL_REVISION,
    PORT,
    Service,
    child_name,
    metadata,
    selector_labels,
    service_url,
)
from hybridllm_operator.llmservice.builders.pool import Pool, tier_components


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
        "metadata": metadata(
            service,
            child_name(service, pool.component, pool.track),
            pool.component,
            revisioned=False,
            track=pool.track,
        ),
        "spec": spec,
    }


def endpoints(service: Service) -> crd.Endpoints:
    urls = {tier: service_url(service, c) for tier, c in tier_components(service).items()}
    return crd.Endpoints(
        gateway=service_url(service, "gateway"), edge=urls.get("edge"), cloud=urls.get("cloud")
    )
