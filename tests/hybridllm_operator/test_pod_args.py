"""Every container command the operator renders is accepted by the runtime it starts.

The operator and the runtimes are separate distributions; a flag renamed on one side
would only show up as a crash-looping pod. Here each pool's args, for every example
manifest and for the settings that change them, go through the runtime's own argument
parser and settings validation.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridllm_cloud import cli as cloud_cli
from hybridllm_common import crd
from hybridllm_edge import cli as edge_cli
from hybridllm_gateway import cli as gateway_cli
from hybridllm_operator.llmservice import builders

EXAMPLES = Path(__file__).parents[2] / "examples"


def _services() -> list[tuple[str, builders.Service]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "LLMService":
                spec = crd.LLMServiceSpec.model_validate(doc["spec"])
                out.append((path.name, builders.Service("svc", "ns", "uid", spec)))
    base = out[0][1].spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    variants: list[dict[str, Any]] = [
        {"cloud": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 2},
                   "kvCache": {"prefixCaching": False}}},
        {"edge": {"enabled": True, "responseCache": {"enabled": False}},
         "model": {"source": base["model"]["source"], "sha256": "ab" * 32}},
    ]  # fmt: skip
    for i, patch in enumerate(variants):
        merged = {**base, **{k: {**base.get(k, {}), **v} for k, v in patch.items()}}
        spec = crd.LLMServiceSpec.model_validate(merged)
        out.append((f"variant-{i}", builders.Service("svc", "ns", "uid", spec)))
    return out


def _parse(add: Any, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(args)


PARSERS = {
    "edge": (edge_cli._add_serve, edge_cli.settings_from_args),
    "monolithic": (cloud_cli._add_serve, cloud_cli.settings_from_args),
    "prefill": (cloud_cli._add_serve, cloud_cli.settings_from_args),
    "decode": (cloud_cli._add_serve, cloud_cli.settings_from_args),
    "gateway": (gateway_cli._add_commands, gateway_cli.settings_from_args),
}


@pytest.mark.parametrize(
    ("name", "service"), _services(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_runtime_accepts_rendered_args(name: str, service: builders.Service) -> None:
    seen = set()
    for pool in builders.pools(service):
        add, settings = PARSERS[pool.component]
        try:
            args = _parse(add, pool.args)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{name}: {pool.component} rejects {pool.args}: {exc}")
        settings(args)  # pydantic validation of the values (raises with the field named)
        seen.add(pool.component)
    assert "gateway" in seen


def test_variants_cover_the_conditional_flags() -> None:
    rendered = {a for _, svc in _services() for pool in builders.pools(svc) for a in pool.args}
    for flag in ("--no-enable-prefix-caching", "--prefill-url", "--kv-port", "--no-cache",
                 "--device", "--role", "--model-sha256"):  # fmt: skip
        assert flag in rendered, flag
