"""Leader election: the Lease rules against the real API server, and two real operator
processes (as the chart's ServiceAccount) of which exactly one reconciles.

The rules (who may take the Lease, when a leader steps down) are checked with clocks the
test moves, so no test waits out a lease duration; the failover test uses a 16 s lease, a 12 s
renew deadline and a 1 s retry, and measures the takeover."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from hybridllm_common import metrics as names
from hybridllm_operator import leader

from .conftest import ROOT, Kube, chart_operator_env, own_control_plane
from .test_k8s_autoscaling import _free_port

pytestmark = pytest.mark.k8s

OPERATOR_COMMAND = (sys.executable, "-m", "hybridllm_common.cli", "operator", "run")
NAMESPACE = "leader-test"
LEASE_NS = "hybridllm"
LEASE = "hybridllm-operator"
# a lease long enough that a handover by release (kopf's shutdown, ~5 s) and a takeover by
# expiry are told apart
TIMING = {"lease": 16.0, "renew": 12.0, "retry": 1.0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def coordination(k8s_cluster: Any, kube: Kube) -> Iterator[tuple[Any, str]]:
    """The real API server's Lease API, and a namespace of the test's own."""
    from kubernetes import client, config

    ns = f"lease-{int(time.time() * 1000) % 10**8}"
    kube.run("create", "namespace", ns)
    api = client.CoordinationV1Api(config.new_client_from_config(str(k8s_cluster.kubeconfig)))
    try:
        yield api, ns
    finally:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)


def _elector(api: Any, ns: str, identity: str, clock: Clock) -> leader.LeaderElector:
    timing = leader.Timing(lease_duration=15, renew_deadline=10, retry_period=2)
    return leader.LeaderElector(api, ns, "op", identity, timing, clock)


def test_a_held_lease_is_taken_only_after_its_duration_without_renewal(
    coordination: tuple[Any, str],
) -> None:
    api, ns = coordination
    clock_a, clock_b = Clock(), Clock()
    a, b = _elector(api, ns, "a", clock_a), _elector(api, ns, "b", clock_b)
    assert a.try_acquire_or_renew()  # creates the Lease
    assert not b.try_acquire_or_renew()  # held: b starts its own count from now
    clock_b.now += 14
    assert not b.try_acquire_or_renew()  # 14 s of silence < 15 s duration
    clock_a.now += 14
    assert a.try_acquire_or_renew()  # a renews: the record changes
    clock_b.now += 14  # 28 s since b first looked, but only 14 since the renewal it saw
    assert not b.try_acquire_or_renew()
    clock_b.now += 16  # 30 s since b last saw a change: a is gone
    assert b.try_acquire_or_renew()
    lease = api.read_namespaced_lease("op", ns).spec
    assert (lease.holder_identity, lease.lease_transitions) == ("b", 1)
    assert b.holder == "b"


def test_two_candidates_racing_for_an_expired_lease_get_one_winner(
    coordination: tuple[Any, str],
) -> None:
    """Both read the expired Lease, both write with the resourceVersion they read: the API
    server accepts exactly one write (the other gets 409)."""
    api, ns = coordination
    clocks = [Clock(), Clock(), Clock()]
    old, b, c = (_elector(api, ns, n, k) for n, k in zip("xbc", clocks, strict=True))
    assert old.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert not c.try_acquire_or_renew()
    clocks[1].now += 20
    clocks[2].now += 20
    start = threading.Barrier(2)
    results: dict[str, bool] = {}

    def race(elector: leader.LeaderElector) -> None:
        start.wait()
        results[elector.identity] = elector.try_acquire_or_renew()

    threads = [threading.Thread(target=race, args=(e,)) for e in (b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holder = api.read_namespaced_lease("op", ns).spec.holder_identity
    assert sorted(results.values()) == [False, True], results
    assert results[holder] is True


def test_a_leader_steps_down_when_it_cannot_renew_or_another_holds_the_lease(
    coordination: tuple[Any, str],
) -> None:
    api, ns = coordination
    clock_a, clock_b = Clock(), Clock()
    a, b = _elector(api, ns, "a", clock_a), _elector(api, ns, "b", clock_b)
    assert a.try_acquire_or_renew()
    # b takes over (a was cut off for longer than the duration, as b sees it)
    assert not b.try_acquire_or_renew()
    clock_b.now += 16
    assert b.try_acquire_or_renew()
    # a's next renewal finds b holding it: a steps down at once, not after its deadline
    lost = threading.Event()
    stop = threading.Event()
    fast = leader.LeaderElector(
        api, ns, "op", "a", leader.Timing(lease_duration=3, renew_deadline=2, retry_period=0.05),
        clock_a,
    )  # fmt: skip
    fast.renewed_at = clock_a.now
    worker = threading.Thread(target=fast.run_renewals, args=(stop, lost.set))
    worker.start()
    worker.join(timeout=30)
    stop.set()
    assert lost.is_set()
    assert not worker.is_alive()
    # released by its holder: free for anyone at once, however recently it was renewed
    b.release()
    assert a.try_acquire_or_renew()


def test_timings_that_would_let_two_leaders_overlap_are_refused() -> None:
    with pytest.raises(ValueError, match="retryPeriod < renewDeadline < leaseDuration"):
        leader.Timing(lease_duration=10, renew_deadline=10, retry_period=2)


# ---------------------------------------------------------------------- two real operators


def _manifest(replicas: int) -> dict[str, Any]:
    """The small example with the edge pool at ``replicas`` (autoscaling off: the spec's
    count is what a reconcile writes, so it shows which operator reconciled)."""
    doc = yaml.safe_load((ROOT / "examples" / "edge-cloud-small.yaml").read_text())
    doc["metadata"] = {"name": "chat", "namespace": NAMESPACE}
    doc["spec"]["edge"]["pool"]["replicas"] = replicas
    doc["spec"]["autoscaling"] = {"mode": "off"}
    return dict(doc)


class Proc:
    def __init__(self, env: dict[str, str], name: str, log: Path) -> None:
        self.name, self.log = name, log
        address = f"127.0.0.1:{_free_port()}"
        self.metrics = f"http://{address}/metrics"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*OPERATOR_COMMAND, "--metrics", address], env={**env, "POD_NAME": name},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def leading(self) -> float | None:
        """``hybridllm_operator_leader`` as its /metrics says (None: not answering yet)."""
        try:
            text = httpx.get(self.metrics, timeout=5).text
        except httpx.TransportError:
            return None
        line = next(x for x in text.splitlines() if x.startswith(names.OPERATOR_LEADER + " "))
        return float(line.split()[1])

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)


@pytest.fixture
def cluster(k8s_cluster: Any, tmp_path: Path) -> Iterator[tuple[Any, Kube]]:
    with own_control_plane(tmp_path / "testenv", NAMESPACE) as pair:
        yield pair


def test_two_operators_one_reconciles_the_other_takes_over_when_it_dies_or_hands_over(
    cluster: tuple[Any, Kube], tmp_path: Path
) -> None:
    cl, kube = cluster
    env = chart_operator_env(cl, kube, dict(os.environ), tmp_path)
    env.update({
        "HYBRIDLLM_OPERATOR_LEASE_DURATION_SECONDS": str(TIMING["lease"]),
        "HYBRIDLLM_OPERATOR_RENEW_DEADLINE_SECONDS": str(TIMING["renew"]),
        "HYBRIDLLM_OPERATOR_RETRY_PERIOD_SECONDS": str(TIMING["retry"]),
    })  # fmt: skip
    procs: list[Proc] = []

    def holder() -> str | None:
        lease = kube.get("lease", LEASE, LEASE_NS)
        return None if lease is None else lease["spec"].get("holderIdentity")

    def edge_replicas() -> int | None:
        deployment = kube.get("deployment", "chat-edge", NAMESPACE)
        return None if deployment is None else deployment["spec"]["replicas"]

    try:
        a = Proc(env, "operator-a", tmp_path / "a.log")
        procs.append(a)
        kube.eventually(lambda: holder() == "operator-a", what="operator-a to lead")
        b = Proc(env, "operator-b", tmp_path / "b.log")
        procs.append(b)
        kube.eventually(lambda: "standing by" in b.text(), what="operator-b standing by")
        # both serve their metrics; only the leader says it leads
        kube.eventually(lambda: b.leading() is not None, what="operator-b's metrics")
        assert (a.leading(), b.leading()) == (1, 0)
        # the standby's page points at the leader
        page = httpx.get(b.metrics.removesuffix("metrics"), timeout=5).text
        assert "this operator replica is a standby; the leader is pod operator-a" in page

        kube.apply(_manifest(1), NAMESPACE)
        kube.eventually(lambda: edge_replicas() == 1, what="the leader's reconcile")
        kube.eventually(  # the leader's page lists it
            lambda: (
                f'<a href="services/{NAMESPACE}/chat">'
                in httpx.get(a.metrics.removesuffix("metrics"), timeout=5).text
            ),
            what="the service on the leader's page",
        )
        # the standby never started its handlers: it watched nothing and wrote nothing
        assert "hybridllm operator configured" in a.text()
        assert "hybridllm operator configured" not in b.text()

        # the leader dies without a word: the standby takes over once the lease runs out
        killed = time.monotonic()
        a.signal(signal.SIGKILL)
        kube.eventually(lambda: holder() == "operator-b", timeout=60, what="operator-b to lead")
        takeover = time.monotonic() - killed
        # not before the lease ran out (b saw the last renewal at most a retry before the
        # kill), and not much after
        assert TIMING["lease"] - 2 * TIMING["retry"] <= takeover, takeover
        assert takeover <= TIMING["lease"] + 2 * TIMING["retry"] + 3, takeover
        kube.apply(_manifest(2), NAMESPACE)
        kube.eventually(lambda: edge_replicas() == 2, what="the new leader's reconcile")
        assert b.leading() == 1
        assert b.text().count("hybridllm operator configured") == 1

        # a clean stop hands over at once: the leader releases the Lease
        a2 = Proc(env, "operator-a", tmp_path / "a2.log")
        procs.append(a2)
        kube.eventually(lambda: "standing by" in a2.text(), what="operator-a standing by")
        stopped = time.monotonic()
        b.signal(signal.SIGTERM)
        assert b.wait() == 0
        kube.eventually(lambda: holder() == "operator-a", timeout=60, what="operator-a to lead")
        handover = time.monotonic() - stopped
        assert "released Lease" in b.text()
        assert handover < TIMING["lease"], handover  # released, not waited out
        lease = kube.get("lease", LEASE, LEASE_NS)
        assert lease is not None
        assert lease["spec"]["leaseTransitions"] == 2
        kube.apply(_manifest(3), NAMESPACE)
        kube.eventually(lambda: edge_replicas() == 3, what="the third leader's reconcile")
        assert "hybridllm operator configured" in a2.text()

        # a leader that finds the Lease taken from it (it was cut off, another took over)
        # stops reconciling and exits, for its Deployment to restart it as a standby
        kube.run("patch", "lease", LEASE, "-n", LEASE_NS, "--type=merge", "-p",
                 json.dumps({"spec": {"holderIdentity": "someone-else"}}))  # fmt: skip
        assert a2.wait(timeout=60) == 4
        assert "stepping down" in a2.text()
        for proc in (a, b, a2):
            assert "Forbidden" not in proc.text(), proc.name  # the chart's RBAC sufficed
        print(f"takeover after SIGKILL: {takeover:.1f} s; handover after SIGTERM: {handover:.1f} s")
    finally:
        for proc in procs:
            proc.signal(signal.SIGKILL)
