"""The device API of the fleet server: the calls devices make, and its probes.

``DeviceAPI`` answers them (enrollment through ``enroll.EnrollAPI``) from the state of a :class:`~hybridllm_operator.edgefleet.server.FleetServer`
(its ``FleetState``: fleets, devices and their desired configs); it checks and
authenticates each call, and hands heartbeats to the server (its planner refreshes the
device's record when it leads; its digest carries them to the leader when it does not).
The protocol is in docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridllm_common import crd, device_tls, signing
from hybridllm_operator.edgefleet import answers
from hybridllm_operator.edgefleet.enroll import EnrollAPI
from hybridllm_operator.edgefleet.records import Device, Fleet

if TYPE_CHECKING:
    from hybridllm_operator.edgefleet.server import FleetServer

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
# A site table's long poll looks again this often: its devices' endpoints and liveness
# move with heartbeats, which wake no poll by themselves.
SITE_RECHECK_S = 2.0
MAX_BODY = 64 * 1024
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class DeviceAPI:
    """The HTTP API on a fleet server's state (one per server)."""

    def __init__(self, server: FleetServer) -> None:
        self.server = server
        self.enrollments = EnrollAPI(server)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._timed])
        app.add_routes([
            web.post("/v1/enroll", self.enrollments.enroll),
            web.get("/v1/devices/{name}", self.device_info),
            web.get("/v1/devices/{name}/config", self.config),
            web.get("/v1/devices/{name}/site-routing", self.site_routing),
            web.post("/v1/devices/{name}/heartbeat", self.heartbeat),
            web.post("/v1/devices/{name}/certificate", self.certificate),
            web.get("/metrics", self.prometheus),
            web.get("/healthz", self.healthz),
        ])  # fmt: skip
        return app

    @web.middleware
    async def _timed(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unmatched"
        start = time.perf_counter()
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
            raise
        finally:
            code = getattr(locals().get("response"), "status", 500)
            self.server.metrics.requests.labels(endpoint=endpoint, code=str(code)).inc()
            if not request.query.get("wait"):
                self.server.metrics.seconds.labels(endpoint=endpoint).observe(
                    time.perf_counter() - start
                )
        return response

    async def healthz(self, request: web.Request) -> web.Response:
        if not all(i.synced.is_set() for i in self.server.state.informers):
            return answers.error(
                503, "not synced with the API server yet", "not_ready", **{"Retry-After": "1"}
            )
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.server.metrics.pending_writes.set(
            len(self.server.writer.dirty) + self.server.writer.writing
        )
        return web.Response(
            body=generate_latest(self.server.metrics.registry),
            headers={"content-type": CONTENT_TYPE_LATEST},
        )

    def _refuse(self, reason: str, status: int, message: str, **headers: str) -> web.Response:
        return answers.refuse(self.server, reason, status, message, **headers)

    async def _authenticate(
        self, request: web.Request, body: bytes
    ) -> tuple[Device | None, web.Response | None]:
        name = request.match_info["name"]
        header = request.headers.get(signing.DEVICE_HEADER)
        if header != name:
            return None, self._refuse("unsigned", 401, f"{signing.DEVICE_HEADER} must name the "
                                                       "device of the path, and the call be signed")  # fmt: skip
        device = self.server.devices.get(name)
        if device is None or device.public_key is None:
            return None, self._refuse(
                "unknown_device", 401, f"no enrolled device {name}: enroll first"
            )
        try:
            signing.check_request(
                device.public_key, request.method, request.path_qs,
                request.headers.get(signing.TIMESTAMP_HEADER, ""),
                request.headers.get(signing.SIGNATURE_HEADER, ""), body, time.time(),
            )  # fmt: skip
        except signing.SignatureError as exc:
            return None, self._refuse("bad_signature", 401, f"{name}: {exc}")
        if device.revoked:
            return None, self._refuse("revoked", 403, f"device {name} is revoked")
        return device, None

    async def device_info(self, request: web.Request) -> web.Response:
        device, refused = await self._authenticate(request, b"")
        if refused is not None:
            return refused
        assert device is not None
        fleet = self.server.fleets.get(device.fleet)
        if fleet is None:
            return answers.error(404, f"fleet {device.fleet} is gone", "unknown_fleet")
        return web.json_response(answers.identity(self.server, fleet, device))

    async def _start_poll(self, request: web.Request) -> tuple[Device, float, str] | web.Response:
        """A long poll's caller, authenticated and approved, with its deadline and the
        version it has; or the refusal."""
        device, refused = await self._authenticate(request, b"")
        if refused is not None:
            return refused
        assert device is not None
        if not device.approved:
            return answers.error(403, f"device {device.name} awaits approval (hybridllm fleet approve "
                               f"{device.name} -n {self.server.namespace})", "not_approved",
                          **{"Retry-After": "10"})  # fmt: skip
        polled = _long_poll(request)
        if isinstance(polled, web.Response):
            return polled
        return device, *polled

    async def _poll(
        self,
        request: web.Request,
        look: Callable[[Device, Fleet, str], tuple[web.Response | None, str]],
        recheck_s: float = MAX_WAIT_S,
    ) -> web.Response:
        """A long poll: ``look(device, fleet, have)`` gives the answer to send now, or None
        and the version the caller already has; then it waits for the fleet to change (or
        ``recheck_s``) until the caller's ``?wait`` is up (304)."""
        started = await self._start_poll(request)
        if isinstance(started, web.Response):
            return started
        device, deadline, have = started
        while True:
            fleet = self.server.fleets.get(device.fleet)
            if fleet is None or fleet.spec is None:
                return answers.error(
                    404, f"fleet {device.fleet} is gone or invalid", "unknown_fleet"
                )
            answer, version = look(device, fleet, have)
            if answer is not None:
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                return web.Response(status=304, headers={"ETag": f'"{version}"'})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fleet.changed.wait(), min(left, recheck_s))

    async def config(self, request: web.Request) -> web.Response:
        def look(device: Device, fleet: Fleet, have: str) -> tuple[web.Response | None, str]:
            want = self.server.state.desired(fleet, device)
            if want is None or fleet.key is None:
                why = self.server.state.content(fleet)[1] or "the fleet has no config yet"
                return answers.error(503, why, "no_config", **{"Retry-After": "10"}), ""
            if str(want.version) != have:
                return web.json_response(
                    self.server.state.document(fleet, device, want),
                    headers={"ETag": f'"{want.version}"'},
                ), ""  # fmt: skip
            return None, str(want.version)

        return await self._poll(request, look)

    async def site_routing(self, request: web.Request) -> web.Response:
        """The routing table of the device's site, signed, for the site gateway the device
        runs (docs/sites.md); long poll like the config (``If-None-Match``, ``?wait``)."""

        def look(device: Device, fleet: Fleet, have: str) -> tuple[web.Response | None, str]:
            assert fleet.spec is not None
            sites = fleet.spec.sites
            if sites is None:
                return answers.error(404, f"fleet {fleet.name} declares no sites (spec.sites): "
                                     "there is no site table to serve", "no_sites"), ""  # fmt: skip
            site = device.labels.get(sites.label)
            if not site:
                return answers.error(409, f"device {device.name} has no label {sites.label}: "
                                     "it is at no site", "no_site"), ""  # fmt: skip
            now = time.time()
            table, why = self.server.state.site_table(fleet, site, now)
            if table is None:
                return answers.error(503, why, "no_table", **{"Retry-After": "10"}), ""
            version = self.server.state.site_version(table)
            if version != have:
                return web.json_response(
                    self.server.state.site_document(fleet, device, site, table, now),
                    headers={"ETag": f'"{version}"'},
                ), ""  # fmt: skip
            return None, version

        return await self._poll(request, look, SITE_RECHECK_S)

    async def certificate(self, request: web.Request) -> web.Response:
        """A TLS certificate for the device's own key, naming the device
        (``hybridllm_common.device_tls``): the gateways verify its runtime with it."""
        body = await request.read()
        device, refused = await self._authenticate(request, body)
        if refused is not None:
            return refused
        assert device is not None
        if not device.approved:
            return answers.error(403, f"device {device.name} awaits approval", "not_approved",
                                 **{"Retry-After": "10"})  # fmt: skip
        fleet = self.server.fleets.get(device.fleet)
        if fleet is None or fleet.key is None:
            return answers.error(503, f"fleet {device.fleet} has no signing key yet", "no_key",
                                 **{"Retry-After": "10"})  # fmt: skip
        namespace = self.server.namespace
        pem = device_tls.issue(fleet.key, fleet.name, namespace, device.name,
                               device.public_key, time.time())  # fmt: skip
        log.info("issued a certificate to device %s (fleet %s)", device.name, fleet.name)
        return web.json_response({
            "certificate": pem, "ca": fleet.device_ca(namespace),
            "serverName": device_tls.server_name(device.name, fleet.name, namespace),
        })  # fmt: skip

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await request.read()
        device, refused = await self._authenticate(request, body)
        if refused is not None:
            return refused
        assert device is not None
        try:
            report = json.loads(body)
            if not isinstance(report, dict):
                raise ValueError("not an object")
            report = check_report(report)
        except ValueError as exc:
            return answers.error(400, f"heartbeat: {exc}", "invalid_heartbeat")
        fleet = self.server.fleets.get(device.fleet)
        bad_endpoint = self.server.state.endpoint_problem(device, report)
        if bad_endpoint is not None:
            log.warning("device %s: %s", device.name, bad_endpoint)
            return answers.error(403, f"heartbeat: {bad_endpoint}", "endpoint_refused")
        now = time.time()
        device.report, device.last_seen, device.heard_at = report, now, now
        device.heard_here, self.server.sharing.heard = True, True
        out: dict[str, Any] = {"approved": device.approved}
        if fleet is not None and fleet.spec is not None:
            if self.server.leading:
                self.server.planner.refresh(fleet, device, now)
            want = self.server.state.desired(fleet, device) if device.approved else None
            out["configVersion"] = want.version if want else None
            out["heartbeatSeconds"] = max(3, fleet.spec.heartbeat_timeout_seconds // 3)
        return web.json_response(out)


def _long_poll(request: web.Request) -> tuple[float, str] | web.Response:
    """A long poll's deadline (``?wait``, at most MAX_WAIT_S) and the version the caller
    has (``If-None-Match``), or the 400 for a bad wait."""
    try:
        wait = min(float(request.query.get("wait", "0")), MAX_WAIT_S)
    except ValueError:
        return answers.error(400, "wait must be a number of seconds", "invalid_wait")
    if not math.isfinite(wait):
        return answers.error(400, "wait must be a finite number of seconds", "invalid_wait")
    have = request.headers.get("If-None-Match", "").strip('"')
    return time.monotonic() + max(0.0, wait), have


_REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "revision": (str,), "configVersion": (int,), "failedVersion": (int,), "healthy": (bool,),
    "endpoint": (str,), "message": (str,), "kpis": (dict,), "siteGateway": (str,),
    "strandedDemand": (list,),
}  # fmt: skip
MAX_STRANDED_BINS = 240  # minutes of stranded demand one heartbeat may carry
_KPIS = ("tokensPerSecond", "ttftP95Seconds", "errorRate", "queueDepth", "requests")


def check_report(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in report.items():
        if key not in _REPORT_FIELDS:
            raise ValueError(f"unknown field {key!r} (known: {', '.join(_REPORT_FIELDS)})")
        if value is None:
            continue
        if not isinstance(value, _REPORT_FIELDS[key]) or (
            key != "healthy" and isinstance(value, bool)
        ):
            raise ValueError(f"{key} has the wrong type")
        out[key] = value
    for key in ("endpoint", "siteGateway"):
        if key in out and not re.match(r"^https?://[^\s/]+(:\d+)?/?$", out[key]):
            raise ValueError(f"{key} must be http(s)://host:port")
    out["message"] = out.get("message", "")[:512]
    if "strandedDemand" in out:
        out["strandedDemand"] = check_stranded(out["strandedDemand"])
    kpis = out.get("kpis") or {}
    for key, value in kpis.items():
        if key not in _KPIS or not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"kpis.{key} is not a known number ({', '.join(_KPIS)})")
    return out


def check_stranded(bins: list[Any]) -> list[tuple[int, float, float]]:
    """A heartbeat's ``strandedDemand``: at most MAX_STRANDED_BINS minutes, each
    ``[start, promptTokens, completionTokens]``, the start a whole minute, the tokens finite
    and not negative. Its times are not judged here: a device's clock off by minutes must
    not cost it its heartbeats; the fleet's status keeps only the minutes of its last day
    (``StatusBuilder.stranded``)."""
    if len(bins) > MAX_STRANDED_BINS:
        raise ValueError(f"strandedDemand has {len(bins)} minutes (at most {MAX_STRANDED_BINS})")
    out = []
    for i, item in enumerate(bins):
        if (
            not isinstance(item, list) or len(item) != 3
            or any(isinstance(x, bool) or not isinstance(x, int | float) for x in item)
        ):  # fmt: skip
            raise ValueError(f"strandedDemand[{i}] is not [start, promptTokens, completionTokens]")
        start, prompt, completion = item
        if not float(start).is_integer() or start < 0 or int(start) % crd.STRANDED_BIN_S:
            raise ValueError(f"strandedDemand[{i}]: start is not a whole minute")
        if not all(math.isfinite(x) and 0 <= x <= 1e12 for x in (prompt, completion)):
            raise ValueError(f"strandedDemand[{i}]: tokens must be finite, 0 to 1e12")
        out.append((int(start), float(prompt), float(completion)))
    return out
