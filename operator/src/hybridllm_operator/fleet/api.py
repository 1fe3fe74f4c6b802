"""The device API of the fleet server: the four calls devices make, and its probes.

``DeviceAPI`` answers them from the state of a :class:`~hybridllm_operator.fleet.server.FleetServer`
(its ``FleetState``: fleets, devices and their desired configs); it checks and
authenticates each call, and hands heartbeats to the server (its planner refreshes the
device's record when it leads; its digest carries them to the leader when it does not).
The protocol is in docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pydantic
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybridllm_common import crd, signing
from hybridllm_operator.fleet import enrollment, waves
from hybridllm_operator.fleet import kube as kube_mod
from hybridllm_operator.fleet.records import Device, Fleet

if TYPE_CHECKING:
    from hybridllm_operator.fleet.server import FleetServer

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
MAX_BODY = 64 * 1024
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _error(status: int, message: str, code: str, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status, headers=headers)


class DeviceAPI:
    """The HTTP API on a fleet server's state (one per server)."""

    def __init__(self, server: FleetServer) -> None:
        self.server = server
        self._tokens: dict[str, tuple[float, dict[str, str] | None]] = {}  # Secrets, cached 10 s
        self._enrolling = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._timed])
        app.add_routes([
            web.post("/v1/enroll", self.enroll),
            web.get("/v1/devices/{name}", self.device_info),
            web.get("/v1/devices/{name}/config", self.config),
            web.post("/v1/devices/{name}/heartbeat", self.heartbeat),
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
            return _error(
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
        self.server.metrics.rejected.labels(reason=reason).inc()
        log.warning("refused (%s): %s", reason, message)
        return _error(status, message, reason, **headers)

    async def enroll(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object", "invalid_json")
        fleet_name, name = body.get("fleet"), body.get("name")
        token, public_text = body.get("token"), body.get("publicKey")
        labels = body.get("labels") or {}
        for field_name, value in (("fleet", fleet_name), ("name", name)):
            if not isinstance(value, str) or not _NAME.match(value) or len(value) > 63:
                return _error(400, f"{field_name} must be a DNS label (lowercase letters, digits, "
                                   "'-'; at most 63)", f"invalid_{field_name}")  # fmt: skip
        assert isinstance(fleet_name, str)
        assert isinstance(name, str)
        if not isinstance(token, str) or not token or len(token) > 256:
            return _error(400, "token is required (an invitation's token or the fleet's "
                               "bootstrap token)", "invalid_token")  # fmt: skip
        try:
            signing.public_key_from_text(public_text if isinstance(public_text, str) else "")
        except signing.SignatureError as exc:
            return _error(400, f"publicKey: {exc}", "invalid_public_key")
        assert isinstance(public_text, str)
        problem = enrollment.label_problem(labels)
        if problem:
            return _error(400, problem, "invalid_labels")
        try:
            facts = crd.DeviceFacts.model_validate(body.get("facts") or {})
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return _error(400, f"facts.{where}: {first['msg']}", "invalid_facts")
        fleet = self.server.fleets.get(fleet_name)
        if fleet is None or fleet.spec is None:
            return self._refuse(
                "unknown_fleet", 404, f"no EdgeFleet {self.server.namespace}/{fleet_name}"
            )
        async with self._enrolling:  # one at a time: the key and name checks see each other
            existing = self.server.devices.get(name)
            if existing is not None and existing.invite is not None:
                return await self._enroll_invited(fleet, existing, token, public_text, labels,
                                                  facts)  # fmt: skip
            return await self._enroll_with_bootstrap(fleet, name, token, public_text, labels,
                                                     facts)  # fmt: skip

    def _key_refusal(self, name: str, public_text: str) -> web.Response | None:
        """One key, one device: a revoked device does not come back under a new name."""
        for other in self.server.devices.values():
            same_key = (
                other.public_key is not None
                and signing.public_key_text(other.public_key) == public_text
            )
            if same_key and other.revoked:
                return self._refuse("revoked", 403, "this device key is revoked")
            if same_key and other.name != name:
                return self._refuse("key_taken", 409, f"this device key is enrolled as "
                                                      f"{other.name}")  # fmt: skip
        return None

    async def _enroll_invited(
        self, fleet: Fleet, device: Device, token: str, public_text: str,
        labels: dict[str, str], facts: crd.DeviceFacts,
    ) -> web.Response:  # fmt: skip
        """An invited device: its token, once, before it expires, with the labels the
        administrator gave it."""
        invite = device.invite
        assert invite is not None
        assert fleet.spec is not None
        if device.fleet != fleet.name:
            return self._refuse("wrong_fleet", 403, f"device {device.name} is invited to "
                                                    f"fleet {device.fleet}")  # fmt: skip
        if not hmac.compare_digest(enrollment.token_sha256(token), invite.token_sha256):
            return self._refuse("bad_token", 401, f"token does not match the invitation of "
                                                  f"device {device.name}")  # fmt: skip
        if invite.used:
            enrolled = device.public_key is not None and (
                signing.public_key_text(device.public_key) == public_text
            )
            if enrolled:  # the same device again (it did not keep the first answer)
                return web.json_response(self._identity(fleet, device), status=200)
            return self._refuse("invite_used", 409, f"the invitation of device {device.name} "
                                                    "is used (a token is good for one key)")  # fmt: skip
        try:
            enrollment.check_expiry(invite.expires, f"the invitation of device {device.name}")
            enrollment.check_labels(labels, device.labels, "the invitation")
        except enrollment.EnrollmentError as exc:
            expired = "expired" in str(exc)
            return self._refuse("invite_expired" if expired else "labels_not_granted",
                                401 if expired else 403, str(exc))  # fmt: skip
        if not waves.matches(device.labels, fleet.spec.selector):
            return self._not_member(fleet)
        refused = self._key_refusal(device.name, public_text)
        if refused is not None:
            return refused
        from kubernetes.client.exceptions import ApiException

        patch = enrollment.claim_patch(invite, public_text, facts)
        try:
            claimed = await asyncio.to_thread(self.server.kube.patch_device, device.name, patch)
        except ApiException as exc:
            if exc.status in (409, 422):  # the test failed: used (or remade) meanwhile
                return self._refuse("invite_used", 409, f"the invitation of device "
                                                        f"{device.name} is used")  # fmt: skip
            if exc.status == 404:
                return self._refuse("unknown_device", 404, f"device {device.name} is gone")
            return self._unrecorded(exc)
        self.server.state.on_device("MODIFIED", device.name, claimed)
        log.info("enrolled invited device %s in fleet %s", device.name, fleet.name)
        return web.json_response(self._identity(fleet, self.server.devices[device.name]),
                                 status=201)  # fmt: skip

    def _unrecorded(self, exc: Exception) -> web.Response:
        """The API server refused or failed the enrollment's write: the device tries again."""
        log.error("an enrollment could not be recorded: %s", exc)
        return self._refuse("not_recorded", 503, "the enrollment could not be recorded (the "
                                                 "fleet server's log says why); try again",
                            **{"Retry-After": "5"})  # fmt: skip

    def _not_member(self, fleet: Fleet) -> web.Response:
        assert fleet.spec is not None
        want = ",".join(f"{k}={v}" for k, v in (fleet.spec.selector or {}).items())
        return self._refuse("not_a_member", 403, f"labels do not match the fleet's "
                                                 f"spec.selector ({want})")  # fmt: skip

    async def _enroll_with_bootstrap(
        self, fleet: Fleet, name: str, token: str, public_text: str,
        labels: dict[str, str], facts: crd.DeviceFacts,
    ) -> web.Response:  # fmt: skip
        """A device with the fleet's bootstrap token: before the token expires; approved by
        hand with the labels it asked for, or by rule with the token's labels."""
        assert fleet.spec is not None
        secret = kube_mod.token_secret(fleet.name, fleet.spec)
        try:
            bootstrap = await self._bootstrap(secret)
        except enrollment.EnrollmentError as exc:
            log.error("the bootstrap token Secret %s cannot be used: %s", secret, exc)
            return self._refuse("bad_token", 401, f"the fleet's bootstrap token (Secret "
                                                  f"{secret}) cannot be used; the fleet "
                                                  "server's log says why")  # fmt: skip
        if bootstrap is None or not hmac.compare_digest(bootstrap.value.encode(), token.encode()):
            return self._refuse("bad_token", 401, f"token does not match Secret {secret}")
        rules = fleet.spec.enrollment
        try:
            enrollment.check_expiry(bootstrap.expires, f"the bootstrap token (Secret {secret})")
            if rules.auto_approve:
                enrollment.check_labels(labels, bootstrap.labels, f"the bootstrap token "
                                                                   f"(Secret {secret})")  # fmt: skip
                labels = bootstrap.labels
        except enrollment.EnrollmentError as exc:
            expired = "expired" in str(exc)
            return self._refuse("token_expired" if expired else "labels_not_granted",
                                401 if expired else 403, str(exc))  # fmt: skip
        if not waves.matches(labels, fleet.spec.selector):
            return self._not_member(fleet)
        refused = self._key_refusal(name, public_text)
        if refused is not None:
            return refused
        existing = self.server.devices.get(name)
        if existing is not None:
            if (
                existing.public_key is None
                or signing.public_key_text(existing.public_key) != public_text
            ):
                return self._refuse("name_taken", 409, f"device name {name} is enrolled with "
                                                       "another key")  # fmt: skip
            return web.json_response(self._identity(fleet, existing), status=200)
        spec = crd.EdgeDeviceSpec(
            fleet=fleet.name, public_key=public_text, approved=rules.auto_approve, facts=facts
        )
        body_obj = kube_mod.device_body(self.server.namespace, fleet.obj, name, labels, spec)
        from kubernetes.client.exceptions import ApiException

        try:
            created = await asyncio.to_thread(self.server.kube.create_device, body_obj)
        except ApiException as exc:
            if exc.status == 409:
                return self._refuse("name_taken", 409, f"device name {name} is taken")
            return self._unrecorded(exc)
        self.server.state.on_device("ADDED", name, created)
        device = self.server.devices[name]
        log.info("enrolled %s in fleet %s (%s)", name, fleet.name,
                 "approved by rule" if rules.auto_approve else "awaiting approval")  # fmt: skip
        return web.json_response(self._identity(fleet, device), status=201)

    async def _bootstrap(self, secret: str) -> enrollment.BootstrapToken | None:
        """The bootstrap token from its Secret (None: no such Secret), cached 10 s."""
        cached = self._tokens.get(secret)
        if cached is None or time.monotonic() - cached[0] >= 10:
            data = await asyncio.to_thread(self.server.kube.secret_data, secret)
            cached = (time.monotonic(), data)
            self._tokens[secret] = cached
        return None if cached[1] is None else enrollment.BootstrapToken.from_secret(cached[1])

    def _identity(self, fleet: Fleet, device: Device) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": device.name,
            "namespace": self.server.namespace,
            "fleet": fleet.name,
            "approved": device.approved,
            "revoked": device.revoked,
        }
        if fleet.key is not None:
            out["fleetPublicKey"] = signing.public_key_text(fleet.key)
            out["keyId"] = signing.key_id(fleet.key)
        return out

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
            return _error(404, f"fleet {device.fleet} is gone", "unknown_fleet")
        return web.json_response(self._identity(fleet, device))

    async def config(self, request: web.Request) -> web.Response:
        device, refused = await self._authenticate(request, b"")
        if refused is not None:
            return refused
        assert device is not None
        if not device.approved:
            return _error(403, f"device {device.name} awaits approval (hybridllm fleet approve "
                               f"{device.name} -n {self.server.namespace})", "not_approved",
                          **{"Retry-After": "10"})  # fmt: skip
        try:
            wait = min(float(request.query.get("wait", "0")), MAX_WAIT_S)
        except ValueError:
            return _error(400, "wait must be a number of seconds", "invalid_wait")
        have = request.headers.get("If-None-Match", "").strip('"')
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            fleet = self.server.fleets.get(device.fleet)
            if fleet is None or fleet.spec is None:
                return _error(404, f"fleet {device.fleet} is gone or invalid", "unknown_fleet")
            want = self.server.state.desired(fleet, device)
            if want is None or fleet.key is None:
                why = self.server.state.content(fleet)[1] or "the fleet has no config yet"
                return _error(503, why, "no_config", **{"Retry-After": "10"})
            if str(want.version) != have:
                return web.json_response(
                    self.server.state.document(fleet, device, want),
                    headers={"ETag": f'"{want.version}"'},
                )
            left = deadline - time.monotonic()
            if left <= 0:
                return web.Response(status=304, headers={"ETag": f'"{want.version}"'})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fleet.changed.wait(), left)

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
            return _error(400, f"heartbeat: {exc}", "invalid_heartbeat")
        fleet = self.server.fleets.get(device.fleet)
        bad_endpoint = self.server.state.endpoint_problem(device, report)
        if bad_endpoint is not None:
            log.warning("device %s: %s", device.name, bad_endpoint)
            return _error(403, f"heartbeat: {bad_endpoint}", "endpoint_refused")
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


_REPORT_FIELDS: dict[str, tuple[type, ...]] = {
    "revision": (str,), "configVersion": (int,), "failedVersion": (int,), "healthy": (bool,),
    "endpoint": (str,), "message": (str,), "kpis": (dict,),
}  # fmt: skip
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
    if "endpoint" in out and not re.match(r"^https?://[^\s/]+(:\d+)?/?$", out["endpoint"]):
        raise ValueError("endpoint must be http(s)://host:port")
    out["message"] = out.get("message", "")[:512]
    kpis = out.get("kpis") or {}
    for key, value in kpis.items():
        if key not in _KPIS or not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"kpis.{key} is not a known number ({', '.join(_KPIS)})")
    return out
