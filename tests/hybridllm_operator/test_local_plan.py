"""Local mode runs what the operator renders, and refuses what it cannot run before starting anything."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridllm_common import crd
from hybridllm_operator import builders
from hybridllm_operator.local import plan as plan_mod

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(
    p
    for p in (REPO / "examples").glob("*.yaml")
    if any(d and d.get("kind") == "LLMService" for d in yaml.safe_load_all(p.read_text()))
)


def _without_addresses(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in builders.ADDRESS_FLAGS:
            skip = True
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_local_runs_the_pools_commands_and_flags_the_operator_renders(
    example: Path, tmp_path: Path
) -> None:
    manifest = plan_mod.load_manifest(example)
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    deployments = [
        o for o in builders.build_children(manifest.service()) if o["kind"] == "Deployment"
    ]
    assert {d["metadata"]["labels"][builders.LABEL_COMPONENT] for d in deployments} == {
        r.component for r in plan.replicas
    }
    for deployment in deployments:
        component = deployment["metadata"]["labels"][builders.LABEL_COMPONENT]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        local = plan.pool(component)
        expected = 1 if component == "gateway" else deployment["spec"]["replicas"]
        assert len([r for r in local if not r.standby]) == expected, component
        # a pool the local autoscaler sizes has a slot up to its maximum, the rest standby
        spec_pool = crd.scaled_pools(manifest.service().spec).get(component)
        if component in plan_mod.local_scaled_pools(manifest.service().spec):
            assert spec_pool is not None
            assert len(local) == max(spec_pool.max_replicas, expected), component
        for replica in local:
            assert Path(replica.command[0]).name == container["command"][0]
            assert _without_addresses(replica.command[1:]) == _without_addresses(container["args"])
            assert replica.command[replica.command.index("--port") + 1] == str(replica.port)
    ports = [r.port for r in plan.replicas] + [r.kv_port for r in plan.replicas if r.kv_port]
    assert len(ports) == len(set(ports)), "every listener gets its own port"


def test_decode_replicas_are_pointed_at_every_prefill_replica(tmp_path: Path) -> None:
    manifest = plan_mod.load_manifest(REPO / "examples" / "disaggregated-gpu.yaml")
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    kv_ports = [r.kv_port for r in plan.pool("prefill")]
    assert len(kv_ports) == 2
    assert all(kv_ports)
    for decode in plan.pool("decode"):
        url = decode.command[decode.command.index("--prefill-url") + 1]
        assert url == ",".join(f"tcp://127.0.0.1:{p}" for p in kv_ports)
    for prefill in plan.pool("prefill"):
        assert prefill.command[prefill.command.index("--kv-port") + 1] == str(prefill.kv_port)


def test_routing_table_is_the_operators_with_ready_replicas_only(tmp_path: Path) -> None:
    manifest = plan_mod.load_manifest(REPO / "examples" / "hybrid-cpu.yaml")
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    edge = plan.pool("edge")[0].url
    table = plan.routing({"edge": [edge], "cloud": []})
    cluster = builders.build_routing_config(manifest.service())
    assert {k: v for k, v in table.items() if k != "tiers"} == {
        k: v for k, v in cluster.items() if k != "tiers"
    }
    assert table["tiers"] == {
        "edge": {
            "backends": [{"url": edge, "revision": "v1", "weight": 100}],
            "scaleFromZero": False,
        }
    }
    assert plan.tiers == {"edge": "edge", "cloud": "monolithic"}


def test_the_plan_survives_its_file(tmp_path: Path) -> None:
    manifest = plan_mod.load_manifest(REPO / "examples" / "disaggregated-gpu.yaml")
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    again = plan_mod.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.service().spec == manifest.spec


def _up(tmp_path: Path, manifest: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    root = tmp_path / "state"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridllm_common.cli",
            "up",
            "-d",
            "--state-root",
            str(root),
            *extra,
            "-f",
            str(manifest),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _manifest(tmp_path: Path, spec_edit: dict[str, object] | None = None, **top: object) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "hybrid-cpu.yaml").read_text())
    doc.update(top)
    for dotted, value in (spec_edit or {}).items():
        node = doc["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


INVALID = {
    "negative replicas": ({"edge.pool.replicas": -1}, "spec.edge.pool.replicas"),
    "unknown field": ({"edge.pool.replicaz": 2}, "spec.edge.pool.replicaz"),
    "quantization the runtime lacks": (
        {"edge.runtime": "onnx", "edge.quantization": "q4_1"},
        "spec.edge.quantization",
    ),
    "bf16 on a CPU pool": ({"cloud.dtype": "bfloat16"}, "spec.cloud.monolithic.resources.gpu"),
    "no tier": ({"edge.enabled": False, "cloud.enabled": False}, "spec"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_an_invalid_manifest_names_the_field_and_starts_nothing(case: str, tmp_path: Path) -> None:
    edit, field = INVALID[case]
    result = _up(tmp_path, _manifest(tmp_path, edit))
    assert result.returncode == 2, result.stderr
    assert field in result.stderr
    assert "is invalid" in result.stderr
    assert not (tmp_path / "state").exists(), "nothing may be started or written"


def test_a_wrong_api_version_is_refused(tmp_path: Path) -> None:
    result = _up(tmp_path, _manifest(tmp_path, apiVersion="hybridllm.io/v9"))
    assert result.returncode == 2
    assert "apiVersion" in result.stderr
    assert "hybridllm.io/v1alpha1" in result.stderr


@pytest.mark.skipif(plan_mod.gpu_count() > 0, reason="this machine has a GPU")
def test_a_gpu_pool_is_refused_on_a_machine_without_one(tmp_path: Path) -> None:
    result = _up(tmp_path, REPO / "examples" / "edge-cloud-small.yaml")
    assert result.returncode == 2
    assert "spec.cloud.monolithic.resources.gpu" in result.stderr
    assert "this machine has 0" in result.stderr
    assert not (tmp_path / "state").exists()


def test_api_keys_secret_needs_a_key_file_locally(tmp_path: Path) -> None:
    result = _up(tmp_path, _manifest(tmp_path, {"gateway.apiKeysSecret": "keys"}))
    assert result.returncode == 2
    assert "spec.gateway.apiKeysSecret" in result.stderr
    assert "--api-keys-file" in result.stderr


def test_a_busy_gateway_port_is_refused(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _up(tmp_path, _manifest(tmp_path), "--port", str(port))
    assert result.returncode == 2
    assert f"port {port}" in result.stderr
    assert "in use" in result.stderr
    assert not any((tmp_path / "state").glob("*/state.json"))


def test_status_and_down_without_a_service_say_so(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    for command in ("status", "down", "logs"):
        result = subprocess.run(
            [sys.executable, "-m", "hybridllm_common.cli", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert result.returncode == 1, command
        assert "no local service" in result.stderr
