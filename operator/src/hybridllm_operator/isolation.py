"""What keeps an LLMService's runtimes to its own gateway, in a cluster.

Two locks, either enough on its own against a pod that skips the gateway (its API keys,
rate limits, safety filter and tenant salt):

- **the backend token**: a Secret per LLMService (``<name>-backend-token``, made once with
  256 random bits, owned by the LLMService) that every gateway and runtime pod of it reads
  into ``HYBRIDLLM_BACKEND_TOKEN``. A runtime answers ``/v1/...`` only with it; the gateway
  sends it to the pods, never to an enrolled device (:mod:`hybridllm_common.backend_auth`).
- **a NetworkPolicy** (``<name>-runtimes``) on the runtime pods: their HTTP port is reached
  from the service's gateway pods and from namespaces labelled
  ``hybridllm.io/metrics=scrape`` (where Prometheus runs: it scrapes ``/metrics`` there),
  and a prefill pool's KV port from the service's decode pods only. It is enforced where
  the cluster's network plugin enforces NetworkPolicy (Calico, Cilium, ...); the token
  holds either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridllm_common import backend_auth

RUNTIME_COMPONENTS = ("edge", "cloud", "prefill", "decode")
SCRAPE_NAMESPACE_LABEL = ("hybridllm.io/metrics", "scrape")


def token_secret_name(service_name: str) -> str:
    return f"{service_name}-backend-token"


def token_env(service_name: str) -> dict[str, Any]:
    """The container env entry that reads the service's backend token."""
    return {
        "name": backend_auth.TOKEN_ENV,
        "valueFrom": {
            "secretKeyRef": {
                "name": token_secret_name(service_name),
                "key": backend_auth.SECRET_KEY,
            }
        },
    }


def build_token_secret(metadata: dict[str, Any]) -> dict[str, Any]:
    """A new token's Secret (``metadata`` names it and makes the LLMService its owner). It is
    created once and never applied again: a second token would lock the running pods out."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "stringData": {backend_auth.SECRET_KEY: backend_auth.new_token()},
    }


def build_network_policy(
    metadata: dict[str, Any],
    selector: Callable[[str], dict[str, str]],
    component_label: str,
    http_port: int,
    kv_port: int,
) -> dict[str, Any]:
    """The runtime pods' ingress: HTTP from the gateway and the metrics scrapers, KV from
    the decode pods; nothing else (egress is left open: a runtime may fetch its model).
    ``selector(component)`` gives the labels of the service's pods of a component."""

    def pods(component: str) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": selector(component)}}

    service_pods = {k: v for k, v in selector("").items() if k != component_label}
    key, value = SCRAPE_NAMESPACE_LABEL
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {
                "matchLabels": service_pods,
                "matchExpressions": [
                    {"key": component_label, "operator": "In", "values": list(RUNTIME_COMPONENTS)}
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [pods("gateway"), {"namespaceSelector": {"matchLabels": {key: value}}}],
                    "ports": [{"protocol": "TCP", "port": http_port}],
                },
                {"from": [pods("decode")], "ports": [{"protocol": "TCP", "port": kv_port}]},
            ],
        },
    }
