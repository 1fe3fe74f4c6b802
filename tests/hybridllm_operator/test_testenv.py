"""The test environment itself behaves as a cluster would where the operator's tests rely
on it."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.k8s


def _ready(kube: Any, pod: str, namespace: str) -> str | None:
    obj = kube.get("pod", pod, namespace) or {}
    conds = (obj.get("status") or {}).get("conditions", [])
    return next((c["status"] for c in conds if c["type"] == "Ready"), None)


def test_a_pod_marked_not_ready_by_the_node_controller_becomes_ready_again(
    kube: Any, namespace: str
) -> None:
    """After an API server outage the node lifecycle controller marks the pods of nodes
    that missed lease renewals not Ready; a kubelet readies them again once its node
    reports. kwok's nodes must too, or a service stays not Ready for good after the
    fault tests kill the API server."""
    kube.run("create", "deployment", "web", "--image=registry.invalid/web:1", "-n", namespace)
    kube.run("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")
    pod = kube.names("pods", namespace, "app=web")[0]
    patch = {
        "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}
    }
    kube.run("patch", "pod", pod, "-n", namespace, "--subresource=status", "-p", json.dumps(patch))
    kube.eventually(lambda: _ready(kube, pod, namespace) == "True", 30, f"{pod} Ready again")
