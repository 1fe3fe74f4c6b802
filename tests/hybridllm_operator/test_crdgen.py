"""The generated CRDs: committed files match the models, and the schema is structural."""

from __future__ import annotations

from pathlib import Path

import yaml

from hybridllm_operator import crdgen

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "hybridllm" / "files" / "crds"


def walk(node: object, path: str = "") -> list[tuple[str, dict]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_committed_crds_match_the_models() -> None:
    assert crdgen.drift(CRDS) == [], "run `hybridllm crds generate` and commit crds/"
    # the Helm chart's copy, which its templates install and upgrade, is the same
    assert crdgen.drift(CHART_CRDS) == [], "run `hybridllm crds generate` and commit the chart"
    assert sorted(p.name for p in CHART_CRDS.glob("*.yaml")) == sorted(crdgen.render())


def test_schemas_are_structural() -> None:
    for text in crdgen.render().values():
        doc = yaml.safe_load(text)
        schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema):
            assert "type" in node, f"{path} has no type"
            assert not {"$ref", "anyOf", "allOf", "oneOf", "title"} & node.keys(), path
            if "properties" in node:
                assert node.get("additionalProperties") in (None,), path


def test_descriptions_everywhere_in_spec() -> None:
    doc = yaml.safe_load(crdgen.render()["hybridllm.io_llmservices.yaml"])
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    undocumented = [
        path
        for path, node in walk(spec)
        if path and "description" not in node and not path.endswith("{}")
    ]
    assert undocumented == []


def test_cel_rules_and_defaults_are_emitted() -> None:
    doc = yaml.safe_load(crdgen.render()["hybridllm.io_llmservices.yaml"])
    root = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = root["properties"]["spec"]
    cloud = spec["properties"]["cloud"]
    rules = [r["rule"] for r in cloud["x-kubernetes-validations"]]
    assert any("disaggregated" in r for r in rules)
    assert cloud["default"]["mode"] == "monolithic"
    assert cloud["default"]["monolithic"]["resources"]["gpu"] == 1
    assert cloud["properties"]["kvCache"]["properties"]["blockSize"]["enum"] == [8, 16, 32, 64, 128]
    assert "metadata.name" in root["x-kubernetes-validations"][0]["rule"]
    columns = [c["name"] for c in doc["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns[:7] == ["Mode", "Edge", "Cloud", "Revision", "Scaling", "Rollout", "Ready"]


def test_cli_check_fails_on_drift_and_generate_fixes_it(tmp_path: Path) -> None:
    from hybridllm_common import cli

    assert cli.main(["crds", "generate", "--output-dir", str(tmp_path), "--check"]) == 1
    assert cli.main(["crds", "generate", "--output-dir", str(tmp_path)]) == 0
    assert cli.main(["crds", "generate", "--output-dir", str(tmp_path), "--check"]) == 0
    (tmp_path / "hybridllm.io_edgefleets.yaml").write_text("# edited by hand\n")
    assert cli.main(["crds", "generate", "--output-dir", str(tmp_path), "--check"]) == 1
