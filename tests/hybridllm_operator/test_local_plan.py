"""Local mode runs what the operator renders, and refuses what it cannot run before starting anything."""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridllm_common import crd
from hybridllm_operator.llmservice import builders, rollout
from hybridllm_operator.local import plan as plan_mod
from hybridllm_operator.local import supervisor as sup

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


def _rollout_at(weight: int, stable: crd.LLMServiceSpec) -> crd.RolloutStatus:
    """A canary of v2 at ``weight`` on every tier, v1 stable (as the controller writes it)."""
    return crd.RolloutStatus(
        phase=crd.RolloutPhase.progressing, stable_revision="v1", canary_revision="v2",
        stable_spec=rollout.spec_wire(stable), step=0, steps=3, routing_generation=4,
        weights={"edge": weight, "cloud": weight},
    )  # fmt: skip


def test_routing_table_is_the_operators_with_ready_replicas_only(tmp_path: Path) -> None:
    """The supervisor writes the operator's table (`builders.routing_config`) with one
    backend per ready replica; during a rollout, the canary's ready replicas at its weight
    and the stable ones at the rest, as the operator weights the two Services."""
    manifest = plan_mod.load_manifest(REPO / "examples" / "hybrid-cpu.yaml")
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    supervisor = sup.Supervisor(plan, tmp_path, out=io.StringIO())
    edge = next(p for p in supervisor.procs if p.replica.name == "edge-0")
    edge.status = "ready"
    supervisor._update_routing()
    table = json.loads(Path(plan.routing_path).read_text())
    cluster = builders.build_routing_config(manifest.service())
    assert {k: v for k, v in table.items() if k != "tiers"} == {
        k: v for k, v in cluster.items() if k != "tiers"
    }
    assert table["tiers"] == {
        "edge": {
            "backends": [
                {
                    "url": edge.replica.url,
                    "revision": "v1",
                    "weight": 100,
                    "device": False,
                    "serverName": "",
                }
            ],
            "scaleFromZero": False,
            "remote": False,
        }
    }
    assert builders.tier_components(plan.service()) == {"edge": "edge", "cloud": "monolithic"}

    # a rollout: v2's replica (placed from the operator's canary pool) at 25%
    v2 = manifest.spec.model_copy(
        update={"model": manifest.spec.model.model_copy(update={"revision": "v2"})}
    )
    supervisor.spec = v2
    supervisor.rollouts.state = _rollout_at(25, manifest.spec)
    canary_pool = next(
        p for p in builders.pools(supervisor.service())
        if p.track == builders.CANARY and p.component == "edge"
    )  # fmt: skip
    canary = sup.Proc(plan_mod.place(canary_pool, 0, 30000), tmp_path / "c.log", status="ready")
    supervisor.procs.append(canary)
    assert canary.replica.name == "edge-canary-0"
    supervisor._update_routing()
    table = json.loads(Path(plan.routing_path).read_text())
    assert table["generation"] == 4
    assert table["revision"] == "v1"
    assert table["tiers"]["edge"]["backends"] == [
        {
            "url": edge.replica.url,
            "revision": "v1",
            "weight": 75,
            "device": False,
            "serverName": "",
        },
        {
            "url": canary.replica.url,
            "revision": "v2",
            "weight": 25,
            "device": False,
            "serverName": "",
        },
    ]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_a_local_canary_runs_the_commands_and_flags_of_the_operators_canary_pools(
    example: Path, tmp_path: Path
) -> None:
    """Mid-rollout the operator renders `NAME-<component>-canary` Deployments for the
    new revision; local mode places the same pools (a new model source here) with its own
    addresses only, and decode replicas point at the canary's prefill replicas."""
    manifest = plan_mod.load_manifest(example)
    model = manifest.spec.model.model_copy(
        update={"revision": "v2", "source": manifest.spec.model.source + "-v2"}
    )
    v2 = manifest.spec.model_copy(update={"model": model})
    service = builders.Service(
        name=manifest.name, namespace=plan_mod.NAMESPACE, uid="local", spec=v2,
        rollout=_rollout_at(50, manifest.spec),
    )  # fmt: skip
    canaries = [p for p in builders.pools(service) if p.track == builders.CANARY]
    assert canaries
    kv = [31000 + i for i in range(len(canaries))]
    deployments = {
        d["metadata"]["name"]: d for d in builders.build_children(service)
        if d["kind"] == "Deployment"
    }  # fmt: skip
    for pool in canaries:
        replica = plan_mod.place(
            pool, 0, 30000, kv_port=kv[0] if pool.component == "prefill" else None, prefill_kv=kv
        )
        container = deployments[builders.child_name(service, pool.component, builders.CANARY)][
            "spec"
        ]["template"]["spec"]["containers"][0]
        assert (replica.track, replica.revision) == ("canary", "v2")
        assert Path(replica.command[0]).name == container["command"][0]
        assert _without_addresses(replica.command[1:]) == _without_addresses(container["args"])
        assert model.source in replica.command
        if pool.component == "decode":
            url = replica.command[replica.command.index("--prefill-url") + 1]
            assert url == ",".join(f"tcp://127.0.0.1:{p}" for p in kv)


def test_apply_takes_what_restarts_or_reloads_and_names_every_field_that_shapes_processes() -> None:
    spec = plan_mod.load_manifest(REPO / "examples" / "hybrid-cpu.yaml").spec
    wire = spec.to_wire()
    wire["model"]["revision"] = "v2"
    wire["rollout"] = {"strategy": "blueGreen"}
    wire["edge"]["quantization"] = "q8_0"
    wire["edge"]["parallel"] = 2
    wire["routing"]["edgeLimits"]["maxPromptTokens"] = 128
    wire["gateway"]["tokensPerMinute"] = 5000
    wire["cloud"]["monolithic"]["resources"]["cpu"] = "2"
    wire["cloud"]["monolithic"]["maxReplicas"] = 3
    # these shape the processes
    wire["edge"]["pool"]["maxReplicas"] = 3
    wire["cloud"]["mode"] = "disaggregated"
    wire["cloud"]["prefill"] = wire["cloud"]["decode"] = dict(wire["cloud"]["monolithic"])
    wire["autoscaling"]["mode"] = "predictive"
    wire["gateway"]["replicas"] = 3
    changes = plan_mod.spec_changes(spec, crd.LLMServiceSpec.model_validate(wire))
    for applied in ("spec.model.revision", "spec.rollout.strategy", "spec.edge.quantization",
                    "spec.routing.edgeLimits.maxPromptTokens", "spec.gateway.tokensPerMinute"):  # fmt: skip
        assert applied in changes
    refused = plan_mod.refused_changes(changes)
    assert "spec.edge.pool.maxReplicas" in refused
    assert "spec.cloud.monolithic.maxReplicas" in refused
    assert "spec.cloud.monolithic.resources.cpu" not in refused
    assert "spec.cloud.mode" in refused
    assert "spec.cloud.prefill" in refused  # new pools
    assert "spec.autoscaling.mode" in refused
    assert "spec.gateway.replicas" in refused
    assert not [c for c in refused if c.startswith(("spec.model", "spec.edge.quant", "spec.rout"))]
    assert plan_mod.spec_changes(spec, spec) == []


def test_apply_to_a_service_that_is_not_running_says_how_to_start_it(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "apply", "-f", str(manifest),
         "--state-root", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "smollm2-cpu is not running" in result.stderr
    assert "hybridllm up -f" in result.stderr
    rollout_cmd = subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "rollout", "promote", "smollm2-cpu",
         "--local", "--state-root", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert rollout_cmd.returncode == 1
    assert "smollm2-cpu is not running" in rollout_cmd.stderr


def test_the_plan_survives_its_file(tmp_path: Path) -> None:
    manifest = plan_mod.load_manifest(REPO / "examples" / "disaggregated-gpu.yaml")
    plan = plan_mod.make_plan(manifest, tmp_path, ports=itertools.count(20000))
    again = plan_mod.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.service().spec == manifest.spec
    # a plan.json written by an earlier version, which kept a tier map, still reads
    earlier = {**json.loads(plan.to_json()), "tiers": {"cloud": "decode"}}
    assert plan_mod.Plan.from_json(json.dumps(earlier)) == plan


def _up(
    tmp_path: Path, manifest: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
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
        env=None if env is None else {**os.environ, **env},
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
    "golden prompt that is not a regex": (
        {"rollout.analysis.goldenPrompts": [{"prompt": "2 + 2 =", "expect": "(4"}]},
        "spec.rollout.analysis.goldenPrompts[0]: Value error, expect: not a regular expression",
    ),
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


def test_a_rollout_step_that_waits_for_edge_devices_is_refused_locally(tmp_path: Path) -> None:
    edit = {
        "edge.devices": {"fleet": "shops"},
        "rollout.steps": [{"weight": 50}, {"weight": 100, "devices": True}],
    }
    result = _up(tmp_path, _manifest(tmp_path, edit))
    assert result.returncode == 2
    assert "spec.rollout.steps[1].devices: local mode enrolls no edge devices" in result.stderr
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


def test_local_autoscaling_takes_the_operators_forecast_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    default = sup.autoscaler_from_env()
    assert (default.bin_s, default.season_s, default.model) == (60.0, 86_400.0, "holt-winters")
    monkeypatch.setenv("HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS", "10")
    monkeypatch.setenv("HYBRIDLLM_OPERATOR_FORECAST_SEASON_SECONDS", "600")
    monkeypatch.setenv("HYBRIDLLM_OPERATOR_FORECAST_MODEL", "seasonal")
    compressed = sup.autoscaler_from_env()
    assert (compressed.bin_s, compressed.season_s, compressed.model) == (10.0, 600.0, "seasonal")


def test_a_bad_forecast_setting_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = _up(
        tmp_path, _manifest(tmp_path), env={"HYBRIDLLM_OPERATOR_FORECAST_SEASON_SECONDS": "5"}
    )
    assert result.returncode == 2, result.stderr
    assert "HYBRIDLLM_OPERATOR_FORECAST_SEASON_SECONDS" in result.stderr
    assert "greater than or equal to 60" in result.stderr
    assert not (tmp_path / "state").exists()


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
