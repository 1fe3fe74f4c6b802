"""Where the Kubernetes client finds its cluster: one rule for every process.

Servers (the operator, the fleet server) run in pods and take their ServiceAccount's
in-cluster config first, falling back to a kubeconfig (a developer's machine, the tests).
Commands a person types (``hybridllm rollout``, ``hybridllm fleet approve``) take the
kubeconfig first (``$KUBECONFIG``, else ``~/.kube/config``), falling back to in-cluster.
"""

from __future__ import annotations

from collections.abc import Callable

import kubernetes


def load(*, in_cluster_first: bool) -> None:
    """Configure the client library; ConfigException when neither source works."""
    loaders: list[Callable[[], None]] = [_in_cluster, _kubeconfig]
    if not in_cluster_first:
        loaders.reverse()
    try:
        loaders[0]()
    except kubernetes.config.ConfigException:
        loaders[1]()


def _in_cluster() -> None:
    kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]


def _kubeconfig() -> None:
    kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
