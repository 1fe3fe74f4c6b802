"""``POST /v1/enroll``: a device joins its fleet with an invitation or the fleet's bootstrap
token (the rules in ``enrollment.py``; the protocol in docs/fleet.md), one enrollment at a
time per server, the record written before the answer."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from typing import TYPE_CHECKING

import pydantic
from aiohttp import web

from hybridllm_common import crd, signing
from hybridllm_operator.edgefleet import answers, enrollment, waves
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet.records import Device, Fleet

if TYPE_CHECKING:
    from hybridllm_operator.edgefleet.server import FleetServer

log = logging.getLogger("hybridllm_operator.edgefleet.api")

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class EnrollAPI:
    """Enrollment on a fleet server's state (one per server)."""

    def __init__(self, server: FleetServer) -> None:
        self.server = server
        self._tokens: dict[str, tuple[float, dict[str, str] | None]] = {}  # Secrets, cached 10 s
        self._enrolling = asyncio.Lock()

    def _refuse(self, reason: str, status: int, message: str, **headers: str) -> web.Response:
        return answers.refuse(self.server, reason, status, message, **headers)

    async def enroll(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return answers.error(400, "body is not JSON", "invalid_json")
        if not isinstance(body, dict):
            return answers.error(400, "body must be a JSON object", "invalid_json")
        fleet_name, name = body.get("fleet"), body.get("name")
        token, public_text = body.get("token"), body.get("publicKey")
        labels = body.get("labels") or {}
        for field_name, value in (("fleet", fleet_name), ("name", name)):
            if not isinstance(value, str) or not _NAME.match(value) or len(value) > 63:
                return answers.error(400, f"{field_name} must be a DNS label (lowercase letters, digits, "
                                   "'-'; at most 63)", f"invalid_{field_name}")  # fmt: skip
        assert isinstance(fleet_name, str)
        assert isinstance(name, str)
        if not isinstance(token, str) or not token or len(token) > 256:
            return answers.error(400, "token is required (an invitation's token or the fleet's "
                               "bootstrap token)", "invalid_token")  # fmt: skip
        try:
            signing.public_key_from_text(public_text if isinstance(public_text, str) else "")
        except signing.SignatureError as exc:
            return answers.error(400, f"publicKey: {exc}", "invalid_public_key")
        assert isinstance(public_text, str)
        problem = enrollment.label_problem(labels)
        if problem:
            return answers.error(400, problem, "invalid_labels")
        try:
            facts = crd.DeviceFacts.model_validate(body.get("facts") or {})
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return answers.error(400, f"facts.{where}: {first['msg']}", "invalid_facts")
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
                return web.json_response(answers.identity(self.server, fleet, device), status=200)
            return self._refuse("invite_used", 409, f"the invitation of device {device.name} "
                                                    "is used (a token is good for one key)")  # fmt: skip
        try:
            enrollment.check_expiry(invite.expires, f"the invitation of device {device.name}")
            enrollment.check_labels(labels, device.labels, "the invitation")
        except enrollment.Expired as exc:
            return self._refuse("invite_expired", 401, str(exc))
        except enrollment.EnrollmentError as exc:
            return self._refuse("labels_not_granted", 403, str(exc))
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
        return web.json_response(answers.identity(self.server, fleet, self.server.devices[device.name]),
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
        except enrollment.Expired as exc:
            return self._refuse("token_expired", 401, str(exc))
        except enrollment.EnrollmentError as exc:
            return self._refuse("labels_not_granted", 403, str(exc))
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
            return web.json_response(answers.identity(self.server, fleet, existing), status=200)
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
        return web.json_response(answers.identity(self.server, fleet, device), status=201)

    async def _bootstrap(self, secret: str) -> enrollment.BootstrapToken | None:
        """The bootstrap token from its Secret (None: no such Secret), cached 10 s."""
        from kubernetes.client.exceptions import ApiException

        cached = self._tokens.get(secret)
        if cached is None or time.monotonic() - cached[0] >= 10:
            try:
                data = await asyncio.to_thread(self.server.kube.secret_data, secret)
            except ApiException as exc:
                if exc.status == 403:  # the chart's fleet.secretNames does not list it
                    raise enrollment.EnrollmentError(
                        "the fleet server may not read it (add it to the chart's fleet.secretNames)"
                    ) from None
                raise
            cached = (time.monotonic(), data)
            self._tokens[secret] = cached
        return None if cached[1] is None else enrollment.BootstrapToken.from_secret(cached[1])
