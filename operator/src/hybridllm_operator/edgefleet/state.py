"""What a fleet server replica knows, in memory, rebuilt from the records it watches.

``FleetState`` runs the informers over EdgeFleets, EdgeDevices, LLMServices and the other
replicas' heartbeat digests (ConfigMaps), and keeps what they say: each fleet and device
(``records.py``), each service, each digest. A follower takes the leader's records as
they arrive and wakes the long polls whose answer moved; a leader's own writes are the
truth, so it keeps its own and merges the digests' heartbeats instead. It also answers
what a device should run: the content from the fleet's LLMService, the config its
assignment says, and that config as a signed document.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import pydantic

from hybridllm_common import crd, device_tls, signing
from hybridllm_operator.edgefleet import api, endpoints, waves
from hybridllm_operator.edgefleet import digest as digests
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet.records import Device, Fleet
from hybridllm_operator.llmservice import builders

log = logging.getLogger(__name__)

SITE_ROUTING_KIND = "SiteRoutingTable"


class FleetState:
    """The fleets, devices, services and digests of one namespace, as this replica sees
    them; ``leading`` says whether its own records are the truth (the leader's)."""

    def __init__(self, kube: kube_mod.Kube, identity: str) -> None:
        self.kube, self.identity = kube, identity
        self.namespace = kube.namespace
        self.leading = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fleets: dict[str, Fleet] = {}
        self.devices: dict[str, Device] = {}
        self.services: dict[str, dict[str, Any]] = {}
        # other replicas' digests by object name: (when this replica saw it, the digest)
        self.digests: dict[str, tuple[float, digests.Digest]] = {}
        self.own_digest_parts: list[str] = []  # names of this replica's digest as written
        self.started = time.time()
        self.informers: list[kube_mod.Informer] = []
        self._wakes: set[str] = set()  # fleets to wake at the next wake-up

    # ------------------------------------------------------------------ informers

    def start_informers(self) -> None:
        for kind, handler in (
            ("EdgeFleet", self.on_fleet),
            ("EdgeDevice", self.on_device),
            ("LLMService", self.on_service),
        ):
            informer = kube_mod.Informer.custom(
                self.kube.custom, self.namespace, kind, self._threadsafe(handler)
            )
            self.informers.append(informer)
            informer.start()
        digest_informer = kube_mod.Informer.config_maps(
            self.kube.core, self.namespace, digests.LABEL, self._threadsafe(self.on_digest)
        )
        self.informers.append(digest_informer)
        digest_informer.start()

    def stop_informers(self) -> None:
        for informer in self.informers:
            informer.stop()

    def _threadsafe(self, handler: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(handler, *args)

        return call

    def on_fleet(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.fleets.pop(name, None)
            return
        try:
            spec: crd.EdgeFleetSpec | None = crd.EdgeFleetSpec.model_validate(obj.get("spec") or {})
            problem = None
        except pydantic.ValidationError as exc:
            spec, problem = None, f"invalid spec: {exc.errors()[0]['msg']}"
        try:
            status = crd.EdgeFleetStatus.model_validate(obj.get("status") or {})
        except pydantic.ValidationError:
            status = crd.EdgeFleetStatus()
        fleet = self.fleets.get(name)
        if fleet is None:
            fleet = Fleet(name, obj, spec, status, problem)
            self.fleets[name] = fleet
        spec_changed = fleet.spec != spec
        fleet.obj, fleet.spec, fleet.problem = obj, spec, problem
        # A leader's own status is the truth (what arrives is the echo of its writes); the
        # others take the leader's, and wake their long polls when what it hands out moved.
        handed_out = not self.leading and (
            (fleet.status.config, fleet.status.previous_config, fleet.status.rollout)
            != (status.config, status.previous_config, status.rollout)
        )
        if not self.leading:
            fleet.status = status
        if spec_changed or handed_out:  # not any status echo: ten thousand polls would wake
            self.wake(fleet)

    def on_device(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.devices.pop(name, None)
            return
        spec = obj.get("spec") or {}
        labels = dict(obj["metadata"].get("labels") or {})
        labels.pop(kube_mod.FLEET_LABEL, None)
        invite = None
        if spec.get("invite") is not None:
            try:
                invite = crd.DeviceInvite.model_validate(spec["invite"])
            except pydantic.ValidationError as exc:
                log.warning("EdgeDevice %s: spec.invite is not valid (%s); ignored", name, exc)
        public = None
        if spec.get("publicKey") is not None or invite is None:
            try:
                public = signing.public_key_from_text(spec.get("publicKey", ""))
            except signing.SignatureError:
                log.warning("EdgeDevice %s has no valid public key; refusing it", name)
        status = dict(obj.get("status") or {})
        device = self.devices.get(name)
        if device is None:
            device = Device(
                name, spec.get("fleet", ""), public, labels, False, False, status=status
            )
            # A restart marks no device offline by itself: each is seen as of now, except
            # those already offline.
            if status.get("phase") != crd.DevicePhase.Offline.value:
                device.last_seen = self.started
            self.devices[name] = device
        elif not self.leading:  # the leader's record; wake the device's poll if it moved
            if status.get("assignedVersion") != device.status.get("assignedVersion"):
                self.wake_soon(spec.get("fleet", ""))
            device.status = status
        device.public_key, device.labels, device.invite = public, labels, invite
        device.fleet = spec.get("fleet", "")
        device.approved, device.revoked = bool(spec.get("approved")), bool(spec.get("revoked"))

    def on_digest(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.digests.pop(name, None)
            return
        try:
            found = digests.decode(obj, api.check_report)
        except ValueError as exc:
            log.warning("ConfigMap %s: %s; ignored", name, exc)
            return
        for device, why in list(found.refused.items())[:10]:
            log.warning("ConfigMap %s: the entry of device %s is left out: %s", name, device, why)
        if found.replica == self.identity:  # one of an earlier process of this pod
            if name not in self.own_digest_parts:
                self.own_digest_parts.append(name)  # deleted or replaced by the next write
            return
        self.digests[name] = (time.time(), found)
        if self.leading:
            self.merge(*self.digests[name])

    def on_service(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.services.pop(name, None)
        else:
            self.services[name] = obj

    def merge(self, observed_at: float, found: digests.Digest) -> None:
        """Take each device's heartbeat from a digest when it is newer than the one held."""
        for name, (seen_at, report) in found.dated(observed_at).items():
            device = self.devices.get(name)
            if device is None or (device.heard_at is not None and device.heard_at >= seen_at):
                continue
            refused = self.endpoint_problem(device, report)
            if refused is not None:  # a digest is another pod's word, checked as a heartbeat
                log.warning("a digest's heartbeat of device %s is left out: %s", name, refused)
                continue
            device.report, device.heard_at, device.heard_here = report, seen_at, False
            if device.last_seen is None or device.last_seen < seen_at:
                device.last_seen = seen_at

    def endpoint_problem(self, device: Device, report: dict[str, Any]) -> str | None:
        """Why the endpoint a heartbeat reports is refused by its fleet (fleet/endpoints.py)."""
        fleet = self.fleets.get(device.fleet)
        if "endpoint" not in report or fleet is None or fleet.spec is None:
            return None
        rules = fleet.spec.enrollment
        return endpoints.problem(
            report["endpoint"], rules.endpoint_networks, rules.plain_http_endpoints
        )

    # ------------------------------------------------------------------ long polls

    def wake(self, fleet: Fleet) -> None:
        fleet.changed.set()
        fleet.changed = asyncio.Event()

    def wake_soon(self, name: str) -> None:
        """Wake a fleet's long polls shortly: the leader writes a wave's assignments one
        record at a time, and each wake-up rechecks every poll of the fleet."""
        if not self._wakes and self.loop is not None:
            self.loop.call_later(0.1, self._wake_pending)
        self._wakes.add(name)

    def _wake_pending(self) -> None:
        for name in self._wakes:
            fleet = self.fleets.get(name)
            if fleet is not None:
                self.wake(fleet)
        self._wakes.clear()

    # ------------------------------------------------------------------ what devices run

    def content(self, fleet: Fleet) -> tuple[dict[str, Any] | None, str | None]:
        """What the fleet's devices should run, from its LLMService, or why there is none."""
        assert fleet.spec is not None
        service, why = self._service(fleet)
        if service is None:
            return None, why
        target = waves.devices_target(service)
        if target.model.sha256 is None:
            return None, (
                f"LLMService {fleet.spec.service} has no spec.model.sha256: devices check "
                "the model they download against it (`hybridllm model list` prints it)"
            )
        return waves.config_content(service.name, target, fleet.spec), None

    def site_table(self, fleet: Fleet, site: str, now: float) -> tuple[dict[str, Any] | None, str]:
        """The routing table of a site's gateways, or why there is none: the fleet's
        LLMService's table (policy, limits, prompts) with the site's online member devices
        as its edge tier and the cloud gateway across the WAN as its cloud tier (remote:
        probed, refused fast while unreachable). The builder is the operator's, so a site
        routes as the cloud gateway does, from nearer."""
        assert fleet.spec is not None
        assert fleet.spec.sites is not None
        service, why = self._service(fleet)
        if service is None:
            return None, why
        if fleet.key is None:
            return None, f"fleet {fleet.name} has no signing key yet"
        label, timeout = fleet.spec.sites.label, fleet.spec.heartbeat_timeout_seconds
        rows = []
        for d in self.devices.values():
            if (d.fleet != fleet.name or not d.approved or d.revoked
                    or d.labels.get(label) != site or not waves.matches(d.labels, fleet.spec.selector)
                    or not d.online(now, timeout)):  # fmt: skip
                continue
            url = d.report.get("endpoint", d.status.get("endpoint"))
            revision = d.report.get("revision", d.status.get("revision")) or ""
            if not url:
                continue
            if url.startswith("https://"):
                rows.append(builders.ServingDevice(
                    url, revision, device_tls.server_name(d.name, fleet.name, self.namespace),
                    fleet.device_ca(self.namespace)))  # fmt: skip
            else:  # the fleet allows plain-http endpoints (spec.enrollment)
                rows.append(builders.ServingDevice(url, revision))
        service = dataclasses.replace(service, devices=tuple(sorted(rows)))
        table = builders.routing_config(service, {"cloud": [fleet.spec.sites.cloud_url]})
        table["tiers"]["cloud"]["remote"] = True  # across the WAN from the site
        return table, ""

    @staticmethod
    def site_version(table: dict[str, Any]) -> str:
        """A site table's version: its content's hash (the long poll's ETag)."""
        return hashlib.sha256(signing.canonical(table)).hexdigest()[:16]

    def site_document(
        self, fleet: Fleet, device: Device, site: str, table: dict[str, Any], now: float
    ) -> dict[str, str]:
        """The site's table for one of its gateways, signed like a config."""
        assert fleet.spec is not None
        assert fleet.key is not None
        payload = {
            "kind": SITE_ROUTING_KIND,
            "namespace": self.namespace,
            "fleet": fleet.name,
            "device": device.name,
            "site": site,
            "version": self.site_version(table),
            "issuedAt": round(now, 3),
            "expiresAt": round(now + fleet.spec.config_valid_seconds, 3),
            "table": table,
        }
        return signing.sign_document(payload, fleet.key)

    def _service(self, fleet: Fleet) -> tuple[builders.Service | None, str]:
        """The fleet's LLMService as the builders take it (its rollout's state included),
        or why there is none."""
        assert fleet.spec is not None
        obj = self.services.get(fleet.spec.service)
        if obj is None:
            return None, f"LLMService {fleet.spec.service} not found"
        try:
            spec = crd.parse_spec(fleet.spec.service, dict(obj.get("spec") or {}))
        except crd.InvalidSpec as exc:
            return None, f"LLMService {fleet.spec.service} is invalid: {exc}"
        raw_rollout = (obj.get("status") or {}).get("rollout")
        state = crd.RolloutStatus.model_validate(raw_rollout) if raw_rollout else None
        return builders.Service(fleet.spec.service, self.namespace, "", spec, rollout=state), ""

    def desired(self, fleet: Fleet, device: Device) -> crd.FleetConfig | None:
        view = waves.DeviceView(
            device.name, device.labels, True, assigned_version=device.status.get("assignedVersion")
        )
        return waves.desired(fleet.status, view)

    def document(self, fleet: Fleet, device: Device, config: crd.FleetConfig) -> dict[str, str]:
        assert fleet.spec is not None
        assert fleet.key is not None
        now = time.time()
        payload = {
            "kind": "EdgeDeviceConfig",
            "namespace": self.namespace,
            "fleet": fleet.name,
            "device": device.name,
            "version": config.version,
            "issuedAt": round(now, 3),
            "expiresAt": round(now + fleet.spec.config_valid_seconds, 3),
            **json.loads(config.content),
        }
        return signing.sign_document(payload, fleet.key)
