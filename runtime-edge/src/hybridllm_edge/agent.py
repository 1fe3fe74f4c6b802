"""``hybridllm-edge agent``: runs on an edge device, serves what its fleet's signed config says.

What it does, in order (docs/fleet.md):

1. Keeps an Ed25519 key pair in its state folder (made on first start; the private key
   never leaves the device) and enrolls with the fleet server with its token (an
   invitation or the fleet's bootstrap token), its name, labels and facts. It pins the fleet's public key it is given then.
2. Long-polls its config. A document is refused, logged and reported, and what runs keeps
   running, when its signature does not match the pinned key, it is for another device
   or fleet, it has expired, or its version is lower than the one running (a replay).
3. Applies a new config: pulls the model through the model store (its sha256 checked),
   starts ``hybridllm-edge serve`` beside the running one (the two alternate between
   ``--port`` and ``--port + 1``), asks it the golden prompt, and only then switches (the
   heartbeat carries the new endpoint) and stops the old one after ``--drain-seconds``.
   A config whose runtime does not come up or answers wrong is reported failed and not
   tried again; the old runtime never stopped.
4. Keeps the last good config on disk: a restart starts it at once, before it talks to the
   server, so a device rebooted without network serves what it served before.
5. Sends a heartbeat with what it runs and its serving KPIs (tokens/s, TTFT p95, error
   rate, queue depth from the runtime's /metrics) at the interval its config gives.

Here: the key and identity on disk, enrollment, the config long-poll and the checks of a
config document, applying a config (``Agent.apply``: which runtime serves), supervising
the runtime, the heartbeat's sending, and the CLI. Starting, checking and stopping a
runtime, and its command line, are ``agent_runtime.py``'s; the heartbeat's body and the
KPIs read from the runtime's /metrics, ``agent_kpis.py``'s; the TLS certificate the
runtime serves with, ``agent_tls.py``'s.

No torch: it imports the model store and httpx, nothing of the runtime but its command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import signal
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import httpx

from hybridllm_common import signing
from hybridllm_edge import agent_kpis, agent_runtime
from hybridllm_edge.agent_kpis import Kpis
from hybridllm_edge.agent_poll import LongPoll, Rejected, open_document, pause
from hybridllm_edge.agent_poll import reason as _reason
from hybridllm_edge.agent_runtime import START_ERRORS, Runtime, serving_part
from hybridllm_edge.agent_runtime import runtime_command as runtime_command  # named here too
from hybridllm_edge.agent_site import SiteGateway, gateway_available, parse_listen
from hybridllm_edge.agent_tls import Certificate, write_file

log = logging.getLogger("hybridllm_edge.agent")

IDENTITY = "identity.json"
KEY = "device.key"
CURRENT = "config.json"  # the last config accepted (running, or failed: see failed.json)
LAST_GOOD = "last-good.json"  # the last config that passed its health check and served
FAILED = "failed.json"


def check_document(
    envelope: Any,
    fleet_key: Any,
    identity: dict[str, Any],
    running_version: int,
    now: float,
) -> dict[str, Any]:
    """The payload of a config the agent may apply, or Rejected naming what is wrong."""
    payload = open_document(envelope, fleet_key, "EdgeDeviceConfig", "device config",
                            identity, now)  # fmt: skip
    version = payload["version"]
    if not isinstance(version, int):
        raise Rejected("version or expiresAt missing")
    if version < running_version:
        raise Rejected(f"version {version} is older than the running {running_version} (replayed)")
    model = payload.get("model") or {}
    if not model.get("uri") or not re.fullmatch(r"[0-9a-f]{64}", str(model.get("sha256") or "")):
        raise Rejected("model uri or sha256 missing")
    return payload


def device_key(path: Path) -> Any:
    """The device's Ed25519 key, made on first start (the private key never leaves it)."""
    if path.exists():
        return signing.private_key_from_text(path.read_text())
    key = signing.generate_key()
    path.touch(mode=0o600)
    path.write_text(signing.private_key_text(key))
    log.info("made the device key %s", signing.key_id(key))
    return key


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = Path(args.state_dir)
        self.state.mkdir(parents=True, exist_ok=True)
        self.key = device_key(self.state / KEY)
        self.identity: dict[str, Any] = self._read(IDENTITY) or {}
        self.running: Runtime | None = None
        self.version = 0
        self.failed_version: int | None = None
        self.message = ""
        self.heartbeat_s = 10.0
        self.poll_s = 30.0
        self.kpis = Kpis()
        self.runtimes = agent_runtime.Launcher(
            self.state,
            Path(args.model_cache) if args.model_cache else self.state / "models",
            args.host, args.port, args.threads, args.advertise_host,
        )  # fmt: skip
        self.rejected = 0
        self._stopping = asyncio.Event()
        self._draining: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self.site = (
            SiteGateway(self.state, args.site_gateway, args.advertise_host)
            if args.site_gateway
            else None
        )
        self.certificate = None if args.plain_http else Certificate(self.state, self.key)
        if self.certificate is not None and self.certificate.held:
            self.runtimes.tls = self.certificate.files  # the last good config serves HTTPS

    # ------------------------------------------------------------------ disk

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self.state / name
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("%s is not JSON; ignoring it", path)
            return None

    def _write(self, name: str, data: dict[str, Any]) -> None:
        write_file(self.state / name, json.dumps(data, indent=1))  # old or new, never half

    # ------------------------------------------------------------------ server calls

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            verify: Any = True
            if self.args.ca_file:
                verify = ssl.create_default_context(cafile=self.args.ca_file)
            self._client = httpx.AsyncClient(
                base_url=self.args.server, verify=verify, timeout=httpx.Timeout(10.0, read=90.0)
            )
        return self._client

    async def _call(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:  # fmt: skip
        signed = signing.sign_request(
            self.key, self.identity["device"], method, path, body, time.time()
        )
        return await self.client().request(
            method, path, content=body or None, headers={**signed, **(headers or {})},
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )  # fmt: skip

    async def enroll(self) -> None:
        """Enroll once (the identity file says it was), then wait for approval."""
        delay = 1.0
        while not self.identity.get("fleetPublicKey"):
            body = {
                "fleet": self.args.fleet, "name": self.args.name, "token": self._token(),
                "publicKey": signing.public_key_text(self.key), "labels": self.args.labels,
                "facts": facts(),
            }  # fmt: skip
            try:
                r = await self.client().post("/v1/enroll", json=body)
            except httpx.HTTPError as exc:
                log.info("fleet server unreachable (%s); enrolling again in %.0f s", exc, delay)
            else:
                if r.status_code in (200, 201) and r.json().get("fleetPublicKey"):
                    self.identity = {**r.json(), "server": self.args.server}
                    self._write(IDENTITY, self.identity)
                    log.info("enrolled as %s/%s in fleet %s (fleet key %s)",
                             self.identity["namespace"], self.identity["device"],
                             self.identity["fleet"], self.identity["keyId"])  # fmt: skip
                    break
                log.error("enrollment refused (%s): %s", r.status_code, _reason(r))
                if r.status_code in (400, 401, 404, 409):
                    raise SystemExit(f"hybridllm-edge agent: enrollment refused: {_reason(r)}")
            await self._pause(delay)
            delay = min(delay * 2, 60.0)

    def _token(self) -> str:
        if self.args.token_file:
            return Path(self.args.token_file).read_text().strip()
        token = self.args.token or os.environ.get("HYBRIDLLM_FLEET_TOKEN", "")
        if not token:
            raise SystemExit("hybridllm-edge agent: give --token, --token-file or "
                             "HYBRIDLLM_FLEET_TOKEN to enroll")  # fmt: skip
        return token

    async def certify(self, switch: bool = True) -> None:
        """Get or renew the runtime's TLS certificate (``agent_tls``). With ``switch``, a
        runtime serving plain HTTP for want of one is replaced by one serving HTTPS."""
        if self.certificate is None:
            return
        if not await self.certificate.renew(lambda m, p: self._call(m, p), self.identity):
            return
        self.runtimes.tls = self.certificate.files
        running = self.running
        if switch and running is not None and running.tls is None:
            log.info("serving plain HTTP on port %d; starting HTTPS beside it", running.port)
            try:
                self._switch(await self.start(running.payload))
            except START_ERRORS as exc:
                self.message = f"could not start the runtime with TLS: {exc}"
                log.error("%s", self.message)

    async def _pause(self, seconds: float) -> None:
        await pause(self._stopping, seconds)

    # ------------------------------------------------------------------ configs

    async def follow(self) -> None:
        """Long-poll the config; apply each new one."""
        fleet_key = signing.public_key_from_text(self.identity["fleetPublicKey"])
        poll = LongPoll("config", self._stopping)
        path = f"/v1/devices/{self.identity['device']}/config"
        while not self._stopping.is_set():
            r = await poll.ask(self._call, path, str(self.version), self.poll_s)
            if r is None:
                continue
            try:
                payload = check_document(
                    r.json(), fleet_key, self.identity, self.version, time.time()
                )
            except (Rejected, ValueError) as exc:
                self.rejected += 1
                self.message = f"rejected a config: {exc}"
                log.warning("rejected a config: %s", exc)
                await self._pause(5.0)
                continue
            await self.apply(r.json(), payload)

    async def apply(self, envelope: dict[str, Any], payload: dict[str, Any]) -> None:
        version = payload["version"]
        self.heartbeat_s = float(payload.get("heartbeatSeconds", self.heartbeat_s))
        self.poll_s = float(payload.get("pollSeconds", self.poll_s))
        if version == self.failed_version:
            return
        if self.running is not None and serving_part(self.running.payload) == serving_part(payload):
            self.running.payload = payload
            self.version = version
            self._write(CURRENT, envelope)
            self._write(LAST_GOOD, envelope)
            log.info("config %d: same model and runtime, nothing to restart", version)
            return
        await self.certify(switch=False)  # the new runtime serves HTTPS from its start
        log.info("config %d: revision %s (%s); starting it beside the running one",
                 version, payload["revision"], payload["model"]["uri"])  # fmt: skip
        try:
            await asyncio.to_thread(self.runtimes.pull, payload)
            started = await self.start(payload)
        except START_ERRORS as exc:
            self.failed_version, self.message = version, f"config {version} failed: {exc}"
            self.version = max(self.version, 0)
            self._write(FAILED, envelope)
            log.error("config %d failed, still serving the previous one: %s", version, exc)
            return
        self.version, self.message = version, ""
        self.failed_version = None
        self._write(CURRENT, envelope)
        self._write(LAST_GOOD, envelope)
        log.info("switched to config %d (revision %s) on port %d", version,
                 payload["revision"], started.port)  # fmt: skip
        self._switch(started)

    def _switch(self, started: Runtime) -> None:
        """Serve from ``started``; the old runtime drains, then stops."""
        old, self.running = self.running, started
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._drain(old))
            self._draining.add(task)  # held: the loop keeps only weak references to tasks
            task.add_done_callback(self._draining.discard)

    async def start(self, payload: dict[str, Any]) -> Runtime:
        """A runtime for this config, beside the running one (on the other port), answering
        its golden prompt; else it is stopped."""
        return await self.runtimes.start(payload, self.running)

    async def _drain(self, old: Runtime) -> None:
        await self._pause(self.args.drain_seconds)
        await self.runtimes.stop(old)

    async def start_last_good(self) -> None:
        """Serve the last good config at once (no server needed): its signature is checked
        again against the pinned key, its expiry is not (it ran before)."""
        envelope = self._read(LAST_GOOD)
        if envelope is None or not self.identity.get("fleetPublicKey"):
            return
        try:
            key = signing.public_key_from_text(self.identity["fleetPublicKey"])
            payload = signing.open_document(envelope, key)
        except signing.SignatureError as exc:
            log.error("the last good config on disk does not verify (%s); not starting it", exc)
            return
        log.info("starting the last good config %d (revision %s) before asking the server",
                 payload["version"], payload["revision"])  # fmt: skip
        try:
            self.running = await self.start(payload)
        except START_ERRORS as exc:
            log.error("the last good config did not start: %s", exc)
            return
        self.version = int(payload["version"])
        self.heartbeat_s = float(payload.get("heartbeatSeconds", self.heartbeat_s))
        self.poll_s = float(payload.get("pollSeconds", self.poll_s))

    # ------------------------------------------------------------------ heartbeats

    async def supervise(self) -> None:
        """Restart the serving runtime if it dies (with back-off), and send heartbeats."""
        delay = 1.0
        while not self._stopping.is_set():
            running = self.running
            if running is not None and running.process.returncode is not None:
                log.error("the runtime on port %d exited with %s; restarting it",
                          running.port, running.process.returncode)  # fmt: skip
                try:
                    self.running = None
                    self.running = await self.start(running.payload)
                    delay = 1.0
                except START_ERRORS as exc:
                    self.message = f"runtime restart failed: {exc}"
                    await self._pause(delay)
                    delay = min(delay * 2, 60.0)
                    self.running = running
                    continue
            if self.identity.get("fleetPublicKey"):
                await self.certify()
                await self.heartbeat()
            await self._pause(self.heartbeat_s)

    async def heartbeat(self) -> None:
        site = self.site
        if site is not None:
            await site.read_stranded()
        sent_at = time.time()
        stranded = site.stranded.due(sent_at) if site else []
        body = await agent_kpis.heartbeat_body(
            self.running, self.kpis, self.version, self.failed_version,
            "; ".join(m for m in (self.message, site.message if site else "") if m),
            site.url if site else None, stranded,
        )  # fmt: skip
        try:
            r = await self._call("POST", f"/v1/devices/{self.identity['device']}/heartbeat", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
        except httpx.HTTPError as exc:
            log.debug("heartbeat not sent: %s", exc)
            return
        if r.status_code == 200:
            self.heartbeat_s = float(r.json().get("heartbeatSeconds") or self.heartbeat_s)
            if site is not None:
                site.stranded.taken(stranded, sent_at)  # the fleet server has them
        else:
            reason = _reason(r)
            log.warning("heartbeat refused (%s): %s", r.status_code, reason)
            named = "strandedDemand" in reason.split("(known:")[0]  # not in a list of fields
            if site is not None and stranded and r.status_code == 400 and named:
                # a server that cannot take them (an older one, say) must not cost the
                # device its heartbeats: the minutes go, said so
                site.stranded.taken(stranded, float("inf"))
                log.warning("dropped %d minute(s) of stranded demand the fleet server refused",
                            len(stranded))  # fmt: skip

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self.start_last_good()
        site = self.site
        if site is not None and self.identity.get("fleetPublicKey"):
            site.start_last_good(
                signing.public_key_from_text(self.identity["fleetPublicKey"]), self.identity
            )
        supervisor = asyncio.create_task(self.supervise())
        tasks = [
            asyncio.create_task(site.supervise(self._stopping)),
            asyncio.create_task(site.count_stranded(self._stopping)),
        ] if site else []  # fmt: skip
        try:
            enrolled = asyncio.create_task(self.enroll())
            await asyncio.wait([enrolled, asyncio.create_task(self._stopping.wait())],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if enrolled.done():
                enrolled.result()
                tasks.append(asyncio.create_task(self.follow()))
                if site is not None:
                    key = signing.public_key_from_text(self.identity["fleetPublicKey"])
                    tasks.append(asyncio.create_task(site.follow(
                        self._call, key, self.identity, lambda: self.poll_s, self._stopping
                    )))  # fmt: skip
                await self._stopping.wait()
            else:
                enrolled.cancel()
        finally:
            supervisor.cancel()
            for task in tasks:
                task.cancel()
            if site is not None:
                await site.stop()
            if self.running is not None:
                await self.runtimes.stop(self.running)
            if self._client is not None:
                await self._client.aclose()


def facts() -> dict[str, Any]:
    out: dict[str, Any] = {
        "cpus": os.cpu_count() or 1,
        "arch": platform.machine()[:32],
        "os": f"{platform.system()} {platform.release()}"[:128],
    }
    with contextlib.suppress(OSError, ValueError):
        out["memoryBytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        out["agentVersion"] = version("hybridllm-runtime-edge")
    return out


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"label {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def add_agent(subparsers: Any) -> None:
    p = subparsers.add_parser("agent", help="enroll with a fleet server and serve its configs")
    p.add_argument("--server", required=True, help="fleet server URL (https://host:8443)")
    p.add_argument("--fleet", required=True, help="EdgeFleet name")
    p.add_argument("--name", default=socket.gethostname().lower().split(".")[0],
                   help="device name (a DNS label; default: the host name)")  # fmt: skip
    p.add_argument("--token", help="the device's invitation token (`hybridllm fleet invite`) or "
                                   "the fleet's bootstrap token; first start only (or "
                                   "HYBRIDLLM_FLEET_TOKEN)")  # fmt: skip
    p.add_argument("--token-file", help="file holding the token")
    p.add_argument("--ca-file", help="CA that signed the server's certificate (PEM)")
    p.add_argument("--labels", type=_labels, default={},
                   help="labels asked for: k=v,k2=v2 (granted by an administrator's approval; "
                        "an invited device has its invitation's)")  # fmt: skip
    p.add_argument("--state-dir", default="/var/lib/hybridllm-agent",
                   help="key, identity, configs and (by default) the model store")  # fmt: skip
    p.add_argument("--model-cache", help="model store folder (default STATE_DIR/models)")
    p.add_argument("--host", default="0.0.0.0", help="address the runtime listens on")
    p.add_argument("--port", type=int, default=8000,
                   help="serving port (a switch uses PORT+1, then PORT again)")  # fmt: skip
    p.add_argument("--advertise-host", default=None,
                   help="host the gateway reaches this device at (default: --host, or the "
                        "host name when that is 0.0.0.0)")  # fmt: skip
    p.add_argument("--plain-http", action="store_true",
                   help="serve plain HTTP, without the certificate the fleet server issues "
                        "(the fleet must allow it: spec.enrollment.plainHTTPEndpoints)")  # fmt: skip
    p.add_argument("--threads", type=int, help="CPU threads of the runtime")
    p.add_argument("--drain-seconds", type=float, default=15.0,
                   help="how long the old runtime keeps answering after a switch")  # fmt: skip
    p.add_argument("--site-gateway", metavar="HOST:PORT", default=None,
                   help="also run the site's gateway here, on this address: the fleet "
                        "(spec.sites) sends it the site's signed routing table (docs/sites.md; "
                        "needs the hybridllm-gateway package)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    p.set_defaults(func=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(getattr(logging, args.log_level.upper()))  # also when the
    # `hybridllm` command configured logging first
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    if args.advertise_host is None:
        args.advertise_host = args.host if args.host != "0.0.0.0" else socket.gethostname()
    if args.site_gateway:
        try:
            parse_listen(args.site_gateway)
        except ValueError as exc:
            raise SystemExit(f"hybridllm-edge agent: {exc}") from None
        if (missing := gateway_available()) is not None:
            raise SystemExit(f"hybridllm-edge agent: {missing}")
    asyncio.run(Agent(args).run())
    return 0
