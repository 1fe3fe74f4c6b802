"""The site gateway an edge agent runs (``hybridllm-edge agent --site-gateway HOST:PORT``).

A site's clients talk to a gateway at the site (docs/sites.md): it answers what the edge
may answer from the site's own devices and sends the rest to the cloud gateway across the
WAN. It is the platform's gateway (``hybridllm-gateway serve``, the package
``hybridllm-gateway`` installed beside the agent), in another configuration: its routing
table comes from the fleet server, signed with the fleet's key like a device's config
(``GET /v1/devices/NAME/site-routing``, long poll), and names the site's devices as the
edge tier and the cloud gateway as the remote cloud tier.

A table is refused, logged and counted, and the one in use kept, when its signature does
not match the pinned fleet key, it is for another device, fleet or namespace, it has
expired, or it was issued in the future. The last good table stays on disk: a restarted
agent starts the gateway on it at once, before it talks to the server (its signature is
checked again, its expiry is not: it served before), so a site whose WAN is down keeps
its gateway through a reboot. The gateway reloads a new table from its file without a
restart; a gateway that exits is started again with back-off.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from hybridllm_edge.agent_poll import Call, LongPoll, Rejected, open_document, pause
from hybridllm_edge.agent_stranded import SCRAPE_S, StrandedLedger, read_counters
from hybridllm_edge.agent_tls import write_file

log = logging.getLogger("hybridllm_edge.agent")

KIND = "SiteRoutingTable"
SIGNED = "site-routing.signed.json"  # the last good document, as the server signed it
TABLE = "site-routing.json"  # its table: what the gateway reads (and reloads)
STOP_GRACE_S = 10.0


def check_site_document(envelope: Any, fleet_key: Any, identity: dict[str, Any], now: float,
                        check_expiry: bool = True) -> dict[str, Any]:  # fmt: skip
    """The payload of a site table the gateway may use, or Rejected naming what is wrong."""
    payload = open_document(envelope, fleet_key, KIND, "site routing table", identity, now,
                            check_expiry)  # fmt: skip
    if not isinstance(payload["version"], str):
        raise Rejected("version or expiresAt missing")
    table = payload.get("table")
    if not isinstance(table, dict) or not isinstance(table.get("tiers"), dict):
        raise Rejected("no routing table in it")
    return payload


def gateway_available() -> str | None:
    """None when this Python can run the gateway; else what to install."""
    if importlib.util.find_spec("hybridllm_gateway") is None:
        return ("--site-gateway runs the platform's gateway, which is not installed here: "
                "pip install hybridllm-gateway (the same version as this agent)")  # fmt: skip
    return None


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (or :PORT, every address) of ``--site-gateway``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--site-gateway {text!r}: expected HOST:PORT")
    return host or "0.0.0.0", int(port)


class SiteGateway:
    """The gateway process and the table it serves, for one agent."""

    def __init__(self, state: Path, listen: str, advertise_host: str) -> None:
        self.state = state
        self.host, self.port = parse_listen(listen)
        self.advertise = f"http://{advertise_host}:{self.port}"
        self.version = ""  # the table in use
        self.site = ""
        self.rejected = 0
        self.message = ""
        self.process: asyncio.subprocess.Process | None = None
        self.stranded = StrandedLedger(state)
        self._metrics: httpx.AsyncClient | None = None  # reads the gateway's counters

    @property
    def url(self) -> str | None:
        """The gateway's address for the heartbeat, while it runs."""
        running = self.process is not None and self.process.returncode is None
        return self.advertise if running else None

    def _accept(self, envelope: dict[str, Any], payload: dict[str, Any]) -> None:
        # the table first (the gateway reloads it), then the document that vouches for it
        write_file(self.state / TABLE, json.dumps(payload["table"], indent=1))
        write_file(self.state / SIGNED, json.dumps(envelope, indent=1))
        self.version, self.site = payload["version"], str(payload.get("site", ""))

    def start_last_good(self, fleet_key: Any, identity: dict[str, Any]) -> bool:
        """Take the last good table on disk (no server needed); whether there is one."""
        try:
            envelope = json.loads((self.state / SIGNED).read_text())
            payload = check_site_document(envelope, fleet_key, identity, time.time(),
                                          check_expiry=False)  # fmt: skip
        except FileNotFoundError:
            return False
        except (ValueError, Rejected) as exc:
            log.error("the last good site table on disk is refused (%s); waiting for one", exc)
            return False
        self._accept(envelope, payload)
        log.info("site gateway: the last good site table (site %s, version %s), before "
                 "asking the server", self.site, self.version)  # fmt: skip
        return True

    async def follow(
        self, call: Call, fleet_key: Any, identity: dict[str, Any], poll_s: Callable[[], float],
        stopping: asyncio.Event,
    ) -> None:  # fmt: skip
        """Long-poll the site's table; take each new one that checks out."""
        poll = LongPoll("site table", stopping)
        path = f"/v1/devices/{identity['device']}/site-routing"
        while not stopping.is_set():
            r = await poll.ask(call, path, self.version, poll_s())
            self.message = poll.refusal or self.message
            if r is None:
                continue
            try:
                envelope = r.json()
                payload = check_site_document(envelope, fleet_key, identity, time.time())
            except (Rejected, ValueError) as exc:
                self.rejected += 1
                self.message = f"rejected a site table: {exc}"
                log.warning("%s", self.message)
                await pause(stopping, 5.0)
                continue
            self._accept(envelope, payload)
            self.message = ""
            edge = (payload["table"]["tiers"].get("edge") or {}).get("backends") or []
            log.info("site gateway: site %s table %s (%d edge backend(s))",
                     self.site, self.version, len(edge))  # fmt: skip

    async def count_stranded(self, stopping: asyncio.Event) -> None:
        """Read the gateway's stranded-demand counters into the ledger every SCRAPE_S (and
        before each heartbeat: ``read_stranded``)."""
        while not stopping.is_set():
            await pause(stopping, SCRAPE_S)
            await self.read_stranded()

    async def read_stranded(self) -> None:
        if self.url is None:
            return
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if self._metrics is None:  # one kept connection for every read
            self._metrics = httpx.AsyncClient(timeout=2.0)
        try:
            r = await self._metrics.get(f"http://{host}:{self.port}/metrics")
            r.raise_for_status()
            counters = read_counters(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("site gateway metrics not read: %s", exc)
            return
        self.stranded.observe(counters, time.time())

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "hybridllm_gateway.cli", "serve",
            "--config", str(self.state / TABLE), "--host", self.host, "--port", str(self.port),
        ]  # fmt: skip

    async def supervise(self, stopping: asyncio.Event) -> None:
        """Run the gateway once there is a table; start it again when it exits."""
        delay = 1.0
        log_file = self.state / "site-gateway.log"
        while not stopping.is_set():
            if not (self.state / TABLE).exists():
                await pause(stopping, 0.5)
                continue
            with log_file.open("ab") as out:
                self.process = await asyncio.create_subprocess_exec(
                    *self.command(), stdout=out, stderr=asyncio.subprocess.STDOUT
                )
            log.info("site gateway on %s:%d (pid %d)", self.host, self.port, self.process.pid)
            started = time.monotonic()
            waiter = asyncio.create_task(self.process.wait())
            await asyncio.wait([waiter, asyncio.create_task(stopping.wait())],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if stopping.is_set():
                break
            self.message = f"the site gateway exited with {self.process.returncode}; restarting"
            log.error("%s (its log: %s)", self.message, log_file)
            if time.monotonic() - started > 60:
                delay = 1.0
            await pause(stopping, delay)
            delay = min(delay * 2, 60.0)

    async def stop(self) -> None:
        if self._metrics is not None:
            await self._metrics.aclose()
            self._metrics = None
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            process.kill()
            await process.wait()
