"""The operator end to end against a real control plane: create, update, drift, delete, invalid specs."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hybridllm_operator.llmservice import builders

pytestmark = pytest.mark.k8s

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SELECTOR = "app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=hybridllm-operator"


def example(name: str) -> dict[str, Any]:
    return dict(
        yaml.safe_load((EXAMPLES / "edge-cloud-small.yaml").read_text())
        | {"metadata": {"name": name}}
    )


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions", []):
        if cond["type"] == type_:
            return dict(cond)
    return None


def ready(kube: Any, name: str, namespace: str) -> dict[str, Any] | None:
    obj = kube.get("llms", name, namespace)
    cond = condition(obj, "Ready")
    if (
        cond
        and cond["status"] == "True"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    ):
        return obj
    return None


def test_create_builds_every_pool_and_reports_ready(
    kube: Any, operator: Any, namespace: str
) -> None:
    kube.apply(example("demo"), namespace)
    obj = kube.eventually(lambda: ready(kube, "demo", namespace), 90, "LLMService demo Ready")
    assert kube.names("deployments", namespace, SELECTOR.format(name="demo")) == [
        "demo-edge",
        "demo-gateway",
        "demo-monolithic",
    ]
    assert kube.names("services", namespace, SELECTOR.format(name="demo")) == [
        "demo-edge",
        "demo-gateway",
        "demo-monolithic",
    ]
    # the runtimes answer their gateway only: a token Secret made once, read by every pod,
    # and a NetworkPolicy on the runtime pods (isolation.py)
    assert kube.names("networkpolicies", namespace, SELECTOR.format(name="demo")) == [
        "demo-runtimes"
    ]
    secret = kube.get("secret", "demo-backend-token", namespace)
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    # every pod was admitted by a namespace that enforces Pod Security "restricted"
    # (conftest.restricted_namespace), whose admission does refuse what falls short
    refused = kube.run("run", "privileged", "--image=x", "--dry-run=server", "-n", namespace,
                       "--overrides", '{"spec": {"hostNetwork": true}}', check=False)  # fmt: skip
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    deployment = kube.get("deployment", "demo-edge", namespace)
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HYBRIDLLM_BACKEND_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "demo-backend-token", "key": "token"}}} in env  # fmt: skip
    status = obj["status"]
    assert status["edgeReplicas"] == "2/2"
    assert status["cloudReplicas"] == "1/1"
    assert status["currentRevision"] == "v1"
    assert status["endpoints"]["gateway"] == f"http://demo-gateway.{namespace}.svc:80"
    assert condition(obj, "Degraded")["status"] == "False"
    # the GPU pool really landed on a GPU node, the edge pool on the edge node
    pods = json.loads(kube.run("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    nodes = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p["spec"]["nodeName"] for p in pods
    }
    assert nodes["monolithic"].startswith("kwok-gpu-")
    assert nodes["edge"] == "kwok-edge-0"
    table = kube.run("get", "llms", "-n", namespace).stdout
    assert table.split("\n")[0].split()[:8] == [
        "NAME",
        "MODE",
        "EDGE",
        "CLOUD",
        "REVISION",
        "SCALING",
        "ROLLOUT",
        "READY",
    ]
    row = table.split("\n")[1].split()[:8]
    assert row[:5] + row[6:] == ["demo", "monolithic", "2/2", "1/1", "v1", "Completed", "True"]
    # the example's mode; kwok's pods have no address the operator can read the gateway's
    # metrics from, so once it has tried, the autoscaler holds and says so (":no-metrics")
    assert row[5] in ("reactive", "reactive:no-metrics"), row


def test_update_replicas_and_switch_to_disaggregated(
    kube: Any, operator: Any, namespace: str
) -> None:
    body = example("svc")
    # the spec's replicas drive the pools here (with autoscaling on, the autoscaler owns
    # them from its first interval: tests/hybridllm_operator/test_k8s_autoscaling.py)
    body["spec"]["autoscaling"] = {"mode": "off"}
    kube.apply(body, namespace)
    kube.eventually(lambda: ready(kube, "svc", namespace), 90, "svc Ready")

    body["spec"]["edge"]["pool"]["replicas"] = 3
    kube.apply(body, namespace)
    kube.eventually(
        lambda: (
            (kube.get("deployment", "svc-edge", namespace) or {}).get("spec", {}).get("replicas")
            == 3
        ),
        60,
        "edge replicas 3",
    )
    obj = kube.eventually(
        lambda: ready(kube, "svc", namespace), 90, "svc Ready with 3 edge replicas"
    )
    assert obj["status"]["edgeReplicas"] == "3/3"

    body["spec"]["cloud"] = {
        "mode": "disaggregated",
        "prefill": {"replicas": 1, "resources": {"gpu": 1}},
        "decode": {"replicas": 2, "resources": {"gpu": 1}},
    }
    kube.apply(body, namespace)
    kube.eventually(
        lambda: (
            kube.names("deployments", namespace, SELECTOR.format(name="svc"))
            == ["svc-decode", "svc-edge", "svc-gateway", "svc-prefill"]
        ),
        60,
        "monolithic replaced by prefill and decode",
    )
    obj = kube.eventually(lambda: ready(kube, "svc", namespace), 90, "svc Ready disaggregated")
    assert obj["status"]["cloudReplicas"] == "3/3"
    assert sorted(obj["status"]["pools"]) == ["decode", "edge", "gateway", "prefill"]
    config = json.loads(kube.get("configmap", "svc-routing", namespace)["data"]["routing.json"])
    assert (
        config["tiers"]["cloud"]["backends"][0]["url"] == f"http://svc-decode.{namespace}.svc:8000"
    )
    assert kube.get("service", "svc-monolithic", namespace) is None


def test_drift_is_repaired(kube: Any, operator: Any, namespace: str) -> None:
    kube.apply(example("drift"), namespace)
    kube.eventually(lambda: ready(kube, "drift", namespace), 90, "drift Ready")

    old_uid = kube.get("service", "drift-gateway", namespace)["metadata"]["uid"]
    kube.run("delete", "service", "drift-gateway", "-n", namespace)
    recreated = kube.eventually(
        lambda: (
            (svc := kube.get("service", "drift-gateway", namespace))
            and svc["metadata"]["uid"] != old_uid
            and svc
        ),
        60,
        "gateway Service recreated",
    )
    assert recreated["spec"]["ports"][0]["port"] == 80

    kube.run("scale", "deployment", "drift-edge", "--replicas=7", "-n", namespace)
    kube.eventually(
        lambda: kube.get("deployment", "drift-edge", namespace)["spec"]["replicas"] == 2,
        60,
        "edge replicas back to 2",
    )

    kube.run("delete", "configmap", "drift-routing", "-n", namespace)
    kube.eventually(
        lambda: kube.get("configmap", "drift-routing", namespace), 60, "routing ConfigMap recreated"
    )


def test_delete_garbage_collects_children(kube: Any, operator: Any, namespace: str) -> None:
    kube.apply(example("gone"), namespace)
    kube.eventually(lambda: ready(kube, "gone", namespace), 90, "gone Ready")
    kube.run("delete", "llms", "gone", "-n", namespace)
    selector = SELECTOR.format(name="gone")
    kube.eventually(
        lambda: (
            not any(
                kube.names(kind, namespace, selector)
                for kind in ("deployments", "services", "configmaps", "networkpolicies", "secrets")
            )
        ),
        90,
        "children garbage-collected",
    )
    kube.eventually(
        lambda: not kube.names("pods", namespace, "app.kubernetes.io/instance=gone"),
        90,
        "pods gone",
    )


def test_spec_the_schema_cannot_catch_is_degraded(kube: Any, operator: Any, namespace: str) -> None:
    body = example("invalid")
    body["spec"]["rollout"] = {"steps": [{"weight": 50}, {"weight": 20}, {"weight": 100}]}
    kube.apply(body, namespace)

    def degraded() -> dict[str, Any] | None:
        cond = condition(kube.get("llms", "invalid", namespace), "Degraded")
        return cond if cond and cond["status"] == "True" else None

    cond = kube.eventually(degraded, 60, "Degraded condition")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.rollout.steps" in cond["message"]
    assert kube.names("deployments", namespace, SELECTOR.format(name="invalid")) == []
    described = kube.run("describe", "llms", "invalid", "-n", namespace).stdout
    assert "weights must increase strictly" in described

    # fixing the spec recovers
    body["spec"]["rollout"] = {"steps": [{"weight": 20}, {"weight": 100}]}
    kube.apply(body, namespace)
    obj = kube.eventually(lambda: ready(kube, "invalid", namespace), 90, "fixed spec Ready")
    assert condition(obj, "Degraded")["status"] == "False"


class _Tracked:
    """Wraps ``reconcile.reconcile`` in the running operator: counts calls per LLMService,
    records any that overlap, can hold one call open, and can fail one with an API error."""

    def __init__(self, name: str, real: Any) -> None:
        self.name, self.real = name, real
        self.lock = threading.Lock()
        self.active = 0
        self.calls = 0
        self.overlaps = 0
        self.hold_next = False
        self.holding = threading.Event()
        self.second = threading.Event()
        self.fail_status: int | None = None
        self.fail_body: str | None = None
        self.fail_left = 0

    def __call__(self, cluster: Any, body: dict[str, Any], *args: Any) -> Any:
        if body["metadata"]["name"] != self.name:
            return self.real(cluster, body, *args)
        with self.lock:
            self.calls += 1
            self.active += 1
            if self.active > 1:
                self.overlaps += 1
                self.second.set()
            hold, self.hold_next = self.hold_next, False
            fail = self.fail_status if self.fail_left > 0 else None
            self.fail_left = max(0, self.fail_left - 1)
        try:
            if fail is not None:
                # imported here: the client library reads $KUBECONFIG when first imported,
                # and the session fixture sets it after collection
                from kubernetes.client import exceptions as k8s_errors

                error = k8s_errors.ApiException(status=fail, reason="injected by the test")
                error.body = self.fail_body
                raise error
            if hold:
                self.holding.set()
                # The window a second reconcile of the same object would need to show up:
                # the test is waiting for an overlap that must not happen.
                self.second.wait(timeout=5)
            return self.real(cluster, body, *args)
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def tracked(monkeypatch: pytest.MonkeyPatch) -> Any:
    from hybridllm_operator.llmservice import reconcile

    def make(name: str) -> _Tracked:
        wrapper = _Tracked(name, reconcile.reconcile)
        monkeypatch.setattr(reconcile, "reconcile", wrapper)
        return wrapper

    return make


def test_child_events_never_reconcile_an_llmservice_twice_at_once(
    kube: Any, operator: Any, namespace: str, tracked: Any
) -> None:
    """While one reconcile of an LLMService runs, its children change (a hand scale, a
    deleted Service): the events wait for it and coalesce into one more reconcile, which
    repairs both."""
    kube.apply(example("serial"), namespace)
    kube.eventually(lambda: ready(kube, "serial", namespace), 90, "serial Ready")
    spy = tracked("serial")
    spy.hold_next = True
    manifest = example("serial")
    manifest["spec"]["edge"]["pool"]["replicas"] = 3
    kube.apply(manifest, namespace)
    assert spy.holding.wait(timeout=60), "the spec change did not reach the reconciler"
    kube.run("scale", "deployment", "serial-edge", "--replicas=9", "-n", namespace)
    kube.run("delete", "service", "serial-gateway", "-n", namespace)
    kube.eventually(
        lambda: (
            kube.get("service", "serial-gateway", namespace)
            and kube.get("deployment", "serial-edge", namespace)["spec"]["replicas"] == 3
            and ready(kube, "serial", namespace)
        ),
        60,
        "the children repaired and the new replica count in place",
    )
    assert spy.overlaps == 0
    assert spy.calls >= 2  # the held one, then the one the child events asked for


def _settled(kube: Any, name: str, namespace: str) -> bool:
    """Every Deployment of the service done rolling out (the Deployment controller writes
    nothing more): after this, no child event comes unless someone changes something."""
    out = kube.run("get", "deployments", "-n", namespace, "-l", SELECTOR.format(name=name),
                   "-o", "json")  # fmt: skip
    items = json.loads(out.stdout)["items"]
    for d in items:
        st, want = d.get("status") or {}, d["spec"]["replicas"]
        progressing = next((c for c in st.get("conditions", []) if c["type"] == "Progressing"), {})
        if not (
            st.get("observedGeneration") == d["metadata"]["generation"]
            and st.get("replicas", 0)
            == st.get("updatedReplicas", 0)
            == st.get("readyReplicas", 0)
            == st.get("availableReplicas", 0)
            == want
            and progressing.get("reason") == "NewReplicaSetAvailable"
        ):
            return False
    return bool(items)


def test_a_conflict_during_a_child_triggered_reconcile_is_retried(
    kube: Any, operator: Any, namespace: str, tracked: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciles a child's deletion asks for fail ten times in a row (409), more than
    the events that deletion brings: they are retried with back-off until one succeeds,
    with no further event to prompt them. (The back-off is shortened for the test.)"""
    from hybridllm_operator.llmservice import handlers

    monkeypatch.setattr(handlers, "RETRY_FIRST_S", 0.2)
    monkeypatch.setattr(handlers, "RETRY_MAX_S", 0.5)
    kube.apply(example("retry"), namespace)
    kube.eventually(lambda: ready(kube, "retry", namespace), 90, "retry Ready")
    kube.eventually(lambda: _settled(kube, "retry", namespace), 60, "rollouts complete")
    spy = tracked("retry")
    spy.fail_status, spy.fail_left = 409, 10
    kube.run("delete", "configmap", "retry-routing", "-n", namespace)
    kube.eventually(
        lambda: kube.get("configmap", "retry-routing", namespace),
        60,
        "routing ConfigMap recreated after the failed reconciles",
    )
    assert spy.fail_left == 0
    assert spy.calls >= 11, spy.calls


def test_a_namespace_being_deleted_ends_the_reconciles_of_its_llmservice(
    kube: Any, operator: Any, namespace: str, tracked: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A write refused because the namespace is being deleted (403, NamespaceTerminating:
    the namespace controller removes the LLMService soon) ends its reconciler with one
    line, not an error and a retry on every child event the deletion brings."""
    kube.apply(example("doomed"), namespace)
    kube.eventually(lambda: ready(kube, "doomed", namespace), 90, "doomed Ready")
    kube.eventually(lambda: _settled(kube, "doomed", namespace), 60, "rollouts complete")
    spy = tracked("doomed")
    spy.fail_status, spy.fail_left = 403, 1
    spy.fail_body = json.dumps({
        "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": f"unable to create new content in namespace {namespace} because it is "
        "being terminated",
        "details": {"causes": [{"reason": "NamespaceTerminating"}]},
    })  # fmt: skip
    kube.run("delete", "configmap", "doomed-routing", "-n", namespace)

    def said(text: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if text in r.getMessage()]

    kube.eventually(
        lambda: said(f"namespace {namespace} is being deleted: no more reconciles"),
        60,
        "the reconciler saying it stops",
    )
    kube.eventually(lambda: said("Daemon 'reconciler' succeeded"), 30, "the reconciler ended")
    assert spy.calls == 1
    assert not [
        r for r in said("reconcile failed")
        if (getattr(r, "k8s_ref", None) or {}).get("name") == "doomed"
    ]  # fmt: skip


def test_a_rollout_window_holds_a_new_revision_with_its_planned_start_until_started_by_hand(
    kube: Any, operator: Any, namespace: str
) -> None:
    """spec.rollout.window: a new revision waits (Scheduled) with the planned start in the
    status while the stable pools keep serving; `hybridllm rollout start` starts it now."""
    opens = (time.gmtime().tm_hour + 3) % 24  # three hours ahead: never now
    body = example("windowed")
    body["spec"]["rollout"] = {
        "steps": [{"weight": 50, "pauseSeconds": 5}, {"weight": 100, "pauseSeconds": 0}],
        "window": {"schedule": [f"{opens:02d}:00-{opens:02d}:30"]},
    }
    kube.apply(body, namespace)
    kube.eventually(lambda: ready(kube, "windowed", namespace), 90, "windowed Ready")
    body["spec"]["model"]["revision"] = "v2"
    kube.apply(body, namespace)

    def rollout_status() -> dict[str, Any]:
        obj = kube.get("llms", "windowed", namespace) or {}
        return dict((obj.get("status") or {}).get("rollout") or {})

    scheduled = kube.eventually(
        lambda: (r := rollout_status()).get("plannedStart") and r, 60, "the planned start"
    )
    assert scheduled["phase"] == "Scheduled"
    assert scheduled["canaryRevision"] == "v2"
    planned = scheduled["plannedStart"]
    assert time.time() < planned < time.time() + 86_400
    assert planned % 86_400 == opens * 3600
    assert "(`hybridllm rollout start` starts it now)" in scheduled["message"]
    # the stable pools serve v1; no canary yet
    assert kube.get("deployment", "windowed-edge-canary", namespace) is None
    edge = kube.get("deployment", "windowed-edge", namespace)
    assert edge is not None
    assert edge["spec"]["template"]["metadata"]["labels"][builders.LABEL_REVISION] == "v1"
    env = {**os.environ, **kube.cluster.env}
    shown = subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "rollout", "status", "windowed",
         "-n", namespace],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert "Scheduled" in shown
    assert "planned start:" in shown
    subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "rollout", "start", "windowed",
         "-n", namespace],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    started = kube.eventually(
        lambda: (r := rollout_status()).get("phase") == "Progressing" and r, 60, "the start"
    )
    assert started.get("plannedStart") is None
    kube.eventually(
        lambda: kube.get("deployment", "windowed-edge-canary", namespace),
        60,
        "the canary's pool",
    )
