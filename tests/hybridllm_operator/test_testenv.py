"""The test environment itself behaves as a cluster would where the operator's tests rely
on it."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.k8s


def _ready(kube: Any, pod: str, namespace: str) -> str | None:
    obj = kube.get("pod", pod, namespace) or {}
    conds = (obj.get("status") or {}).get("conditions", [])
    return next((c["status"] for c in conds if c["type"] == "Ready"), None)


def _web(kube: Any, namespace: str) -> None:
    """One kwok pod, rolled out. Test namespaces enforce Pod Security "restricted", so the
    pod meets it (the operator's pods share the same settings)."""
    from hybridllm_operator.llmservice.builders import CONTAINER_SECURITY, POD_SECURITY

    labels = {"app": "web"}
    kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web", "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "securityContext": POD_SECURITY,
                        "containers": [
                            {
                                "name": "web",
                                "image": "registry.invalid/web:1",
                                "securityContext": CONTAINER_SECURITY,
                            }
                        ],
                    },
                },
            },
        },
        namespace,
    )
    kube.run("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")


def test_a_pod_marked_not_ready_by_the_node_controller_becomes_ready_again(
    kube: Any, namespace: str
) -> None:
    """After an API server outage the node lifecycle controller marks the pods of nodes
    that missed lease renewals not Ready; a kubelet readies them again once its node
    reports. kwok's nodes must too, or a service stays not Ready for good after the
    fault tests kill the API server."""
    _web(kube, namespace)
    pod = kube.names("pods", namespace, "app=web")[0]
    patch = {
        "status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}
    }
    kube.run("patch", "pod", pod, "-n", namespace, "--subresource=status", "-p", json.dumps(patch))
    kube.eventually(lambda: _ready(kube, pod, namespace) == "True", 30, f"{pod} Ready again")


def test_a_component_that_dies_at_once_fails_the_wait_with_its_log(
    testenv: Any, tmp_path: Path
) -> None:
    """An exited child is a zombie until reaped, and signal 0 still reaches a zombie: the
    wait must see it gone, not wait out its timeout."""
    testenv._start(tmp_path, "dies", ["sh", "-c", "echo bind: address already in use; exit 3"])
    with pytest.raises(testenv.TestEnvError) as caught:
        testenv._wait("nothing", lambda: False, 600, tmp_path, "dies")
    assert "dies exited while waiting for nothing" in str(caught.value)
    assert "address already in use" in str(caught.value)


def test_a_port_taken_before_its_component_binds_it_starts_the_plane_again(
    testenv: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first port picked (etcd's) is taken by another process before etcd binds it:
    the control plane starts again on new ports and comes up."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks: list[int] = []
        free_port = testenv._free_port

        def pick() -> int:
            picks.append(port if not picks else free_port())
            return picks[-1]

        monkeypatch.setattr(testenv, "_free_port", pick)
        state = tmp_path / "plane"
        cluster = testenv.up(state)
        try:
            assert picks.count(port) == 1
            assert len(picks) > 5  # a second round of ports
            assert testenv._https_ok(f"{cluster.server}/readyz", state / "pki")
            assert f":{port}" not in cluster.server
        finally:
            testenv.down(state)
    assert not state.exists()


def test_a_connect_to_a_kwok_pod_fails_on_this_host(kube: Any, namespace: str) -> None:
    """kwok's pods have addresses nothing answers on; a connect to one (the operator
    reading a gateway pod directly) must fail here at once, not leave the machine by the
    default route."""
    if os.geteuid() != 0:
        pytest.skip("the route is set as root")
    _web(kube, namespace)
    pod = kube.get("pod", kube.names("pods", namespace, "app=web")[0], namespace)
    ip = pod["status"]["podIP"]
    with socket.socket() as s:
        s.settimeout(5)
        err = s.connect_ex((ip, 8000))
    assert err == errno.EHOSTUNREACH, os.strerror(err)


def test_the_unreachable_route_is_held_by_every_plane_and_removed_by_the_last(
    testenv: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two control planes hold the route; it goes with the second, and a route that was
    there before any plane is left alone."""
    if os.geteuid() != 0:
        pytest.skip("the route is set as root")
    cidr = "10.255.254.0/24"  # a range of this test's own, so the session's route is untouched
    monkeypatch.setattr(testenv, "KWOK_CIDR", cidr)
    monkeypatch.setattr(testenv, "ROUTE_HOLDERS", tmp_path / "holders")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()

    def routed() -> bool:
        out = subprocess.run(
            ["ip", "route", "show", "type", "unreachable", cidr],
            capture_output=True,
            text=True,
            check=True,
        )
        return bool(out.stdout.strip())

    assert not routed()
    try:
        testenv.hold_kwok_route(a)
        testenv.hold_kwok_route(b)
        assert routed()
        testenv.release_kwok_route(a)
        assert routed(), "the route went while another plane held it"
        b.rmdir()  # a plane killed without its down: its holder is stale
        testenv.release_kwok_route(a)
        assert not routed(), "the last holder's release left the route"
        assert not (tmp_path / "holders").exists(), "the holders' folder was left behind"
        subprocess.run(["ip", "route", "add", "unreachable", cidr], check=True)
        testenv.hold_kwok_route(a)
        testenv.release_kwok_route(a)
        assert routed(), "a route that was there before was removed"
    finally:
        subprocess.run(["ip", "route", "del", "unreachable", cidr], check=False)
