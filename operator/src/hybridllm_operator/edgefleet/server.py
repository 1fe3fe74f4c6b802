"""The fleet server: the HTTPS API edge devices call, with its state in Kubernetes.

Devices call four endpoints (docs/fleet.md has the protocol):

- ``POST /v1/enroll``: bootstrap token, the device's public key, name, labels and facts;
  makes an ``EdgeDevice`` (approved at once when the fleet's rules say so).
- ``GET /v1/devices/NAME``: whether the device is approved, and the fleet's public key.
- ``GET /v1/devices/NAME/config``: the signed config the device should run; long poll
  (``If-None-Match`` with the version it has, ``?wait=SECONDS``).
- ``POST /v1/devices/NAME/heartbeat``: what it runs, its endpoint and its serving KPIs.

Every call but enrollment is signed with the device's key (``hybridllm_common.signing``).

Heartbeats stay in memory. A device's record is written only when something in it
changes (phase, revision, endpoint, health, a failed update), and the fleet's status when
its counts or its rollout change, so ten thousand devices beating every forty seconds
cost no write at all while nothing happens. A restarted server starts every device that
was not offline as seen at its start, so a restart alone marks no device offline.

Each tick (``--tick-seconds``) the server follows each fleet's LLMService: the content
devices should run comes from the service's edge tier (``waves.config_content``), and
:func:`waves.plan` moves a new revision through the fleet wave by wave.

Replicas: every replica answers every call, but one, the holder of the Lease
(``leader.py``, client-go's rules), plans and writes the records. The others serve
configs from the records the leader writes (they watch them) and hand the heartbeats
they receive to the leader through their digests (``digest.py``). A new leader counts
each device not offline as seen at its takeover, as a restarted server does.

Where each concern lives:

- ``api.py``: the device API (``DeviceAPI``: the four calls, /metrics, /healthz).
- ``state.py``: the in-memory state the informers build (``FleetState``: fleets,
  devices, services, the other replicas' digests), the long polls' wake-ups, and what a
  device should run (its content, its desired config, the signed document).
- ``planner.py``: the leader's tick over each fleet (``Planner``: waves, assignments,
  demand, hand commands, each device's recorded status) and the fleet's status
  (``StatusBuilder``: counts, KPIs per revision, conditions).
- ``writer.py``: the leader's writes of the records (``RecordWriter``).
- ``sharing.py``: this replica's heartbeat digest and the leader's collection of stale
  ones (``DigestSharing``); ``digest.py`` their format.
- ``metrics.py`` the Prometheus metrics, ``records.py`` the fleet and device records.
- here: ``FleetServer``, which composes them, takes over and hands over the lead
  (``lead``, driven by ``elect``) and runs the ticks; and ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import threading
import time
from collections.abc import Callable

from aiohttp import web

from hybridllm_common import crd
from hybridllm_operator import leader
from hybridllm_operator.edgefleet import api
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet.metrics import Metrics
from hybridllm_operator.edgefleet.planner import DEMAND_BIN_S, Planner
from hybridllm_operator.edgefleet.sharing import DigestSharing
from hybridllm_operator.edgefleet.state import FleetState
from hybridllm_operator.edgefleet.writer import RecordWriter, _with_nulls

# Names other modules and tests know from here; Metrics and _with_nulls are re-exported.
__all__ = [
    "DEMAND_BIN_S",
    "TLS_READ_BUFFER",
    "FleetServer",
    "Metrics",
    "_with_nulls",
    "elect",
    "serve",
]

log = logging.getLogger(__name__)

TLS_READ_BUFFER = 32 * 1024


class FleetServer:
    """One replica: its state, planner, record writer and digest, and whether it leads."""

    def __init__(
        self,
        kube: kube_mod.Kube,
        tick_s: float = 1.0,
        identity: str = "",
        digest_s: float = 5.0,
        demand_bin_s: float = DEMAND_BIN_S,
    ) -> None:
        self.kube, self.tick_s, self.digest_s = kube, tick_s, digest_s
        self.demand_bin_s = demand_bin_s
        self.identity = identity or leader.default_identity()
        self.namespace = kube.namespace
        self.metrics = Metrics()
        self.metrics.writes.counts = lambda: dict(kube.writes)
        self.state = FleetState(kube, self.identity)
        self.writer = RecordWriter(kube, self.state)
        self.planner = Planner(kube, self.state, self.writer, self.metrics, demand_bin_s)
        self.sharing = DigestSharing(kube, self.state, self.metrics, digest_s)
        # the state's tables and informer handlers, under the names they had here
        state = self.state
        self.fleets, self.devices = state.fleets, state.devices
        self.services, self.digests = state.services, state.digests
        self._on_fleet, self._on_device = state.on_fleet, state.on_device
        self._on_service, self._on_digest = state.on_service, state.on_digest

    @property
    def leading(self) -> bool:
        return self.state.leading

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.state.loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.state.loop = loop

    # ------------------------------------------------------------------ leadership

    def lead(self, leading: bool) -> None:
        """Take over (True) or hand over (False) the planning and the writes."""
        if leading == self.leading:
            return
        now = time.time()
        self.state.leading = leading
        self.metrics.leader.set(int(leading))
        if leading:
            log.info("leading the fleets of %s as %s", self.namespace, self.identity)
            for observed_at, found in self.state.digests.values():
                self.state.merge(observed_at, found)
            for d in self.state.devices.values():  # as a restart: none offline for the takeover
                if d.status.get("phase") != crd.DevicePhase.Offline.value:
                    d.last_seen = max(d.last_seen or now, now)
            self.sharing.take_over()
        else:
            log.warning("no longer leading the fleets of %s: serving, not planning", self.namespace)
            self.writer.forget()
            self.planner.status.forget()  # the new leader exports the gauges

    # ------------------------------------------------------------------ the tick

    async def run_ticks(self) -> None:
        writer = asyncio.create_task(self.writer.run(self.tick_s))
        try:
            while True:
                try:
                    await self.tick()
                except Exception:  # a bug must not stop the fleet: say so, go on
                    log.exception("fleet tick failed")
                await asyncio.sleep(self.tick_s)
        finally:
            writer.cancel()

    async def tick(self) -> None:
        now = time.time()
        if not self.leading:
            await self._follow(now)
            return
        for fleet in list(self.state.fleets.values()):
            await self.planner.tick_fleet(fleet, now)
        await self.sharing.collect(now)

    async def _follow(self, now: float) -> None:
        """A replica that does not lead: ready to sign configs, and its digest written."""
        for fleet in list(self.state.fleets.values()):
            if fleet.spec is not None and fleet.key is None:  # None: may not read it
                fleet.key, _ = await asyncio.to_thread(self.kube.signing_key_or_problem, fleet.obj)
        await self.sharing.follow(now)

    # ------------------------------------------------------------------ the device API

    def app(self) -> web.Application:
        """The device API (``api.DeviceAPI``) on this server's state."""
        return api.DeviceAPI(self).app()


def elect(server: FleetServer, elector: leader.LeaderElector, stop: threading.Event) -> None:
    """Lead while holding the Lease, follow otherwise, until ``stop`` (then release it).
    Runs in a thread of its own (the elector blocks)."""
    loop = server.loop
    assert loop is not None

    def lost() -> None:
        loop.call_soon_threadsafe(server.lead, False)

    while not stop.is_set():
        if not elector.acquire(stop):
            break
        loop.call_soon_threadsafe(server.lead, True)
        elector.run_renewals(stop, lost)
    if elector.holder == elector.identity:
        elector.release()


async def serve(
    namespace: str,
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    tick_s: float = 1.0,
    ready: Callable[[], None] | None = None,
    *,
    lease: str = "hybridllm-fleet",
    timing: leader.Timing | None = None,
    identity: str = "",
    digest_s: float = 5.0,
    demand_bin_s: float = DEMAND_BIN_S,
) -> None:
    if tls is not None:
        from asyncio import sslproto

        sslproto.SSLProtocol.max_size = TLS_READ_BUFFER  # this process serves devices only
    kube = kube_mod.Kube(namespace)
    server = FleetServer(kube, tick_s, identity, digest_s, demand_bin_s)
    server.loop = asyncio.get_running_loop()
    server.state.start_informers()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    await site.start()
    log.info("fleet server for namespace %s on %s://%s:%d", namespace,
             "https" if tls else "http", host, port)  # fmt: skip
    for informer in server.state.informers:
        await asyncio.to_thread(informer.synced.wait)
    # Election starts once the caches are full: a new leader plans from the records.
    timing = timing or leader.Timing()
    elector = leader.LeaderElector(kube.leases, namespace, lease, server.identity, timing)
    stop = threading.Event()
    electing = threading.Thread(target=elect, args=(server, elector, stop), name="lease",
                                daemon=True)  # fmt: skip
    electing.start()
    if ready is not None:
        ready()
    ticking = asyncio.ensure_future(server.run_ticks())
    with contextlib.suppress(NotImplementedError):  # SIGTERM (a rolling update): hand over
        server.loop.add_signal_handler(signal.SIGTERM, ticking.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
    finally:
        stop.set()
        await asyncio.to_thread(electing.join, timing.retry_period + 10)
        if not server.leading and server.state.own_digest_parts:
            await server.sharing.write([])  # gone: the leader need not wait it out
        server.state.stop_informers()
        await runner.cleanup()
