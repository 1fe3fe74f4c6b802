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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import pydantic
from aiohttp import web

from hybridllm_common import crd, signing
from hybridllm_operator import builders, leader, reconcile, rollout
from hybridllm_operator.fleet import api, endpoints, waves
from hybridllm_operator.fleet import digest as digests
from hybridllm_operator.fleet import kube as kube_mod
from hybridllm_operator.fleet.metrics import Metrics
from hybridllm_operator.fleet.records import Device, Fleet

log = logging.getLogger(__name__)

TLS_READ_BUFFER = 32 * 1024
# Fields of a device's status the server writes when they change (not lastSeen alone).
_RECORDED = ("phase", "revision", "configVersion", "assignedVersion", "assignedWave",
             "failedVersion", "endpoint", "healthy", "message")  # fmt: skip


DEMAND_BIN_S = 600.0  # the bins of each device group's demand history
DEMAND_SAMPLE_S = 15.0  # how often a group's request rate is sampled (at most)


class FleetServer:
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
        self.leading = False
        self.namespace = kube.namespace
        # other replicas' digests by object name: (when this replica saw it, the digest)
        self.digests: dict[str, tuple[float, digests.Digest]] = {}
        self._digest_parts: list[str] = []  # names of this replica's digest as written
        self._digest_names: set[str] = set()  # devices in it
        self._digest_at = 0.0
        self._heard = False  # a device beat to this replica since its last digest
        self._wakes: set[str] = set()  # fleets to wake at the next wake-up
        self._tasks: set[asyncio.Task[None]] = set()
        self.fleets: dict[str, Fleet] = {}
        self.devices: dict[str, Device] = {}
        self.services: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.metrics = Metrics()
        self.metrics.writes.counts = lambda: dict(kube.writes)
        self.dirty: set[str] = set()
        self.writing = 0  # records taken from dirty, not yet sent
        self.loop: asyncio.AbstractEventLoop | None = None
        self._informers: list[kube_mod.Informer] = []
        self._kpi_revisions: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ Kubernetes side

    def start_informers(self) -> None:
        for kind, handler in (
            ("EdgeFleet", self._on_fleet),
            ("EdgeDevice", self._on_device),
            ("LLMService", self._on_service),
        ):
            informer = kube_mod.Informer.custom(
                self.kube.custom, self.namespace, kind, self._threadsafe(handler)
            )
            self._informers.append(informer)
            informer.start()
        digest_informer = kube_mod.Informer.config_maps(
            self.kube.core, self.namespace, digests.LABEL, self._threadsafe(self._on_digest)
        )
        self._informers.append(digest_informer)
        digest_informer.start()

    def stop_informers(self) -> None:
        for informer in self._informers:
            informer.stop()

    def _threadsafe(self, handler: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(handler, *args)

        return call

    def _on_fleet(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
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
            self._wake(fleet)

    def _on_device(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
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
                self._wake_soon(spec.get("fleet", ""))
            device.status = status
        device.public_key, device.labels, device.invite = public, labels, invite
        device.fleet = spec.get("fleet", "")
        device.approved, device.revoked = bool(spec.get("approved")), bool(spec.get("revoked"))

    def _on_digest(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
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
            if name not in self._digest_parts:
                self._digest_parts.append(name)  # deleted or replaced by the next write
            return
        self.digests[name] = (time.time(), found)
        if self.leading:
            self._merge(*self.digests[name])

    def _merge(self, observed_at: float, found: digests.Digest) -> None:
        """Take each device's heartbeat from a digest when it is newer than the one held."""
        for name, (seen_at, report) in found.dated(observed_at).items():
            device = self.devices.get(name)
            if device is None or (device.heard_at is not None and device.heard_at >= seen_at):
                continue
            refused = self._endpoint_problem(device, report)
            if refused is not None:  # a digest is another pod's word, checked as a heartbeat
                log.warning("a digest's heartbeat of device %s is left out: %s", name, refused)
                continue
            device.report, device.heard_at, device.heard_here = report, seen_at, False
            if device.last_seen is None or device.last_seen < seen_at:
                device.last_seen = seen_at

    def _endpoint_problem(self, device: Device, report: dict[str, Any]) -> str | None:
        """Why the endpoint a heartbeat reports is refused by its fleet (fleet/endpoints.py)."""
        fleet = self.fleets.get(device.fleet)
        if "endpoint" not in report or fleet is None or fleet.spec is None:
            return None
        return endpoints.problem(report["endpoint"], fleet.spec.enrollment.endpoint_networks)

    def lead(self, leading: bool) -> None:
        """Take over (True) or hand over (False) the planning and the writes."""
        if leading == self.leading:
            return
        now = time.time()
        self.leading = leading
        self.metrics.leader.set(int(leading))
        if leading:
            log.info("leading the fleets of %s as %s", self.namespace, self.identity)
            for observed_at, found in self.digests.values():
                self._merge(observed_at, found)
            for d in self.devices.values():  # as a restart: none offline for the takeover
                if d.status.get("phase") != crd.DevicePhase.Offline.value:
                    d.last_seen = max(d.last_seen or now, now)
            self._digest_names, self._heard = set(), False
            self._write_digest_soon([])  # the leader's own heartbeats need none
        else:
            log.warning("no longer leading the fleets of %s: serving, not planning", self.namespace)
            self.dirty.clear()
            for fleet in self.fleets.values():
                fleet.written, fleet.written_at = {}, 0.0
            m = self.metrics
            for gauge in (m.devices, m.revision_devices, m.revision_tokens, m.revision_errors,
                          m.revision_ttft, m.heartbeat_age):  # fmt: skip
                gauge.clear()  # the new leader exports them
            self._kpi_revisions.clear()

    def _on_service(self, type_: str, name: str, obj: dict[str, Any] | None) -> None:
        if obj is None:
            self.services.pop(name, None)
        else:
            self.services[name] = obj

    # ------------------------------------------------------------------ what devices run

    def content(self, fleet: Fleet) -> tuple[dict[str, Any] | None, str | None]:
        """What the fleet's devices should run, from its LLMService, or why there is none."""
        assert fleet.spec is not None
        obj = self.services.get(fleet.spec.service)
        if obj is None:
            return None, f"LLMService {fleet.spec.service} not found"
        try:
            spec = reconcile.parse_spec(fleet.spec.service, dict(obj.get("spec") or {}))
        except reconcile.InvalidSpec as exc:
            return None, f"LLMService {fleet.spec.service} is invalid: {exc}"
        raw_rollout = (obj.get("status") or {}).get("rollout")
        state = crd.RolloutStatus.model_validate(raw_rollout) if raw_rollout else None
        service = builders.Service(fleet.spec.service, self.namespace, "", spec, rollout=state)
        target = waves.devices_target(service)
        if target.model.sha256 is None:
            return None, (
                f"LLMService {fleet.spec.service} has no spec.model.sha256: devices check "
                "the model they download against it (`hybridllm model list` prints it)"
            )
        return waves.config_content(service.name, target, fleet.spec), None

    def views(self, fleet: Fleet, now: float) -> list[waves.DeviceView]:
        assert fleet.spec is not None
        timeout = fleet.spec.heartbeat_timeout_seconds
        out = []
        for d in self.devices.values():
            if d.fleet != fleet.name or not d.approved or d.revoked:
                continue
            report, st = d.report, d.status
            out.append(waves.DeviceView(
                name=d.name, labels=d.labels, online=d.online(now, timeout),
                healthy=bool(report.get("healthy", st.get("healthy"))),
                config_version=report.get("configVersion", st.get("configVersion")),
                assigned_version=st.get("assignedVersion"), assigned_wave=st.get("assignedWave"),
                assigned_at=st.get("assignedAt"),
                failed_version=report.get("failedVersion", st.get("failedVersion")),
            ))  # fmt: skip
        return out

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

    # ------------------------------------------------------------------ the tick

    async def run_ticks(self) -> None:
        writer = asyncio.create_task(self.run_writer())
        try:
            while True:
                try:
                    await self.tick()
                except Exception:  # a bug must not stop the fleet: say so, go on
                    log.exception("fleet tick failed")
                await asyncio.sleep(self.tick_s)
        finally:
            writer.cancel()

    async def run_writer(self) -> None:
        """Write changed device records in the background: a tick never waits for them,
        and a record that changes again before its turn is written once."""
        while True:
            if self.dirty and self.leading:
                await self.flush()
            else:
                await asyncio.sleep(self.tick_s / 2)

    async def tick(self) -> None:
        now = time.time()
        if not self.leading:
            await self._follow(now)
            return
        for fleet in list(self.fleets.values()):
            await self._tick_fleet(fleet, now)
        await self._collect_digests(now)

    async def _follow(self, now: float) -> None:
        """A replica that does not lead: ready to sign configs, and its digest written."""
        for fleet in list(self.fleets.values()):
            if fleet.spec is not None and fleet.key is None:
                fleet.key = await asyncio.to_thread(self.kube.signing_key, fleet.obj)
        if now - self._digest_at < self.digest_s:
            return
        seen: dict[str, tuple[float, dict[str, Any]]] = {}
        for d in self.devices.values():
            its = self.fleets.get(d.fleet)
            keep = its.spec.heartbeat_timeout_seconds if its and its.spec else 120
            if d.heard_here and d.heard_at is not None and now - d.heard_at <= keep:
                seen[d.name] = (d.heard_at, d.report)
        if not self._heard and set(seen) == self._digest_names:
            return  # nothing new: the leader's reading of the last digest still holds
        self._heard, self._digest_names, self._digest_at = False, set(seen), now
        self.metrics.digest_devices.set(len(seen))
        await self._write_digest(digests.encode(self.identity, now, seen))

    def _write_digest_soon(self, parts: list[str]) -> None:
        if self.loop is not None:
            task = self.loop.create_task(self._write_digest(parts))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _write_digest(self, parts: list[str]) -> None:
        """This replica's digest as ``parts`` (none: deleted), older extra parts deleted."""
        names = [digests.object_name(self.identity, i) for i in range(len(parts))]
        labels = {digests.LABEL: "true", digests.REPLICA_LABEL: digests.label_value(self.identity)}
        try:
            for name, text in zip(names, parts, strict=True):
                await asyncio.to_thread(
                    self.kube.write_config_map, name, labels, {digests.KEY: text}
                )
            for name in set(self._digest_parts) - set(names):
                await asyncio.to_thread(self.kube.delete_config_map, name)
            self._digest_parts = names
        except Exception as exc:  # noqa: BLE001 - the API server: the next period tries again
            log.warning("heartbeat digest of %s not written: %s", self.identity, exc)
            self._heard = True

    async def _collect_digests(self, now: float) -> None:
        """The leader deletes the digests of replicas gone: unchanged for twice the longest
        heartbeat timeout (nothing in them can make a device online any more)."""
        timeouts = [f.spec.heartbeat_timeout_seconds for f in self.fleets.values() if f.spec]
        stale = 2 * max(timeouts, default=120)
        for name, (observed_at, found) in list(self.digests.items()):
            if now - observed_at > stale:
                log.info("deleting the heartbeat digest %s of replica %s, silent %.0f s",
                         name, found.replica, now - observed_at)  # fmt: skip
                self.digests.pop(name, None)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.kube.delete_config_map, name)

    async def _tick_fleet(self, fleet: Fleet, now: float) -> None:
        if fleet.spec is None:
            await self._write_fleet(fleet, fleet.status, now, fleet.problem)
            return
        if fleet.key is None:
            fleet.key = await asyncio.to_thread(self.kube.signing_key, fleet.obj)
        content, problem = self.content(fleet)
        views = self.views(fleet, now)
        before = fleet.status
        self._sample_demand(fleet, now)
        action = self._action(fleet)
        start_now = action is not None and action.split("@", 1)[0] == "start"
        profiles = (
            {k: h.profile(now) for k, h in fleet.demand.items()}
            if fleet.spec.rollout.window is not None
            else {}
        )
        planned = waves.plan(before, fleet.spec, content, views, now, profiles, start_now)
        if action is not None:
            await self._took_action(fleet, action, planned)
        status = planned.status
        status.signing_key_id = signing.key_id(fleet.key)
        for name, (version, wave) in planned.assign.items():
            device = self.devices[name]
            device.status.update(
                {"assignedVersion": version, "assignedWave": wave, "assignedAt": round(now, 3)}
            )
            self.dirty.add(name)
        self._count(fleet, status, now)
        fleet.status = status
        for type_, reason, message in planned.events:
            log.info("fleet %s: %s: %s", fleet.name, reason, message)
            await asyncio.to_thread(self.kube.event, fleet.obj, type_, reason, message)
        if (
            planned.assign
            or before.config != status.config
            or before.previous_config != status.previous_config
            or before.rollout != status.rollout
        ):
            self._wake(fleet)
        for d in self.devices.values():
            if d.fleet == fleet.name:
                self._refresh(fleet, d, now)
        await self._write_fleet(fleet, status, now, problem)

    def _sample_demand(self, fleet: Fleet, now: float) -> None:
        """Each device group's request rate now (the requests its online members reported
        over their last heartbeat interval), into its history: what plans the waves."""
        assert fleet.spec is not None
        if now - fleet.sampled_at < min(DEMAND_SAMPLE_S, self.demand_bin_s / 4):
            return
        fleet.sampled_at = now
        spec = fleet.spec
        timeout, interval = spec.heartbeat_timeout_seconds, waves.heartbeat_seconds(spec)
        online = [
            d for d in self.devices.values()
            if d.fleet == fleet.name and d.approved and not d.revoked
            and d.online(now, timeout) and waves.matches(d.labels, spec.selector)
        ]  # fmt: skip
        for key, labels in waves.groups(spec).items():
            requests = sum(
                float((d.report.get("kpis") or {}).get("requests", 0.0))
                for d in online
                if waves.matches(d.labels, labels)
            )
            history = fleet.demand.setdefault(key, waves.DemandHistory(self.demand_bin_s))
            history.add(now, requests / interval)

    def _action(self, fleet: Fleet) -> str | None:
        """A hand command on the fleet (the annotation), once."""
        meta = fleet.obj.get("metadata") or {}
        action = (meta.get("annotations") or {}).get(rollout.ACTION_ANNOTATION)
        if not action or action == fleet.handled_action:
            return None
        return str(action)

    async def _took_action(self, fleet: Fleet, action: str, planned: waves.Plan) -> None:
        """Say what a hand command did, and remove it."""
        fleet.handled_action = action
        verb = action.split("@", 1)[0]
        if verb != "start":
            why = f"unknown action {verb!r} on an EdgeFleet (known: start)"
            planned.events.append(("Warning", "UnknownRolloutAction", why))
        elif not any(reason == "FleetWaveStarted" for _, reason, _ in planned.events):
            why = "start: no wave waits for its window"
            planned.events.append(("Normal", "RolloutActionIgnored", why))
        await asyncio.to_thread(
            self.kube.annotate_fleet, fleet.name, rollout.ACTION_ANNOTATION, None
        )

    def _wake(self, fleet: Fleet) -> None:
        fleet.changed.set()
        fleet.changed = asyncio.Event()

    def _wake_soon(self, name: str) -> None:
        """Wake a fleet's long polls shortly: the leader writes a wave's assignments one
        record at a time, and each wake-up rechecks every poll of the fleet."""
        if not self._wakes and self.loop is not None:
            self.loop.call_later(0.1, self._wake_pending)
        self._wakes.add(name)

    def _wake_pending(self) -> None:
        for name in self._wakes:
            fleet = self.fleets.get(name)
            if fleet is not None:
                self._wake(fleet)
        self._wakes.clear()

    def _count(self, fleet: Fleet, st: crd.EdgeFleetStatus, now: float) -> None:
        assert fleet.spec is not None
        timeout = fleet.spec.heartbeat_timeout_seconds
        members = [d for d in self.devices.values() if d.fleet == fleet.name]
        approved = [d for d in members if d.approved and not d.revoked]
        online = [d for d in approved if d.online(now, timeout)]
        st.devices = len(approved)
        st.pending_devices = sum(1 for d in members if not d.approved and not d.revoked)
        st.offline_devices = len(approved) - len(online)
        revisions: dict[str, int] = {}
        for d in online:
            rev = d.report.get("revision", d.status.get("revision"))
            if rev:
                revisions[rev] = revisions.get(rev, 0) + 1
        st.revisions = revisions
        current_rev = st.config.revision if st.config else None
        st.updated_devices = sum(
            1 for d in approved if d.report.get("revision", d.status.get("revision")) == current_rev
        )
        st.ready_devices = sum(
            1 for d in online
            if d.report.get("healthy", d.status.get("healthy"))
            and d.report.get("revision", d.status.get("revision")) == current_rev
        )  # fmt: skip
        self._kpis(fleet.name, online)
        ages = [now - d.last_seen for d in online if d.last_seen is not None]
        st.oldest_heartbeat_seconds = round(max(ages), 1) if ages else None
        for quantile, age in (("0.5", statistics.median(ages) if ages else None),
                              ("1", max(ages) if ages else None)):  # fmt: skip
            if age is None:
                with contextlib.suppress(KeyError):
                    self.metrics.heartbeat_age.remove(fleet.name, quantile)
            else:
                self.metrics.heartbeat_age.labels(fleet.name, quantile).set(age)
        for phase in crd.DevicePhase:
            self.metrics.devices.labels(fleet=fleet.name, phase=phase.value).set(
                sum(1 for d in members if d.status.get("phase") == phase.value)
            )

    def _kpis(self, fleet: str, online: list[Device]) -> None:
        """The devices' heartbeat KPIs per revision, on /metrics (not in any record)."""
        by_revision: dict[str, list[dict[str, Any]]] = {}
        for d in online:
            revision = d.report.get("revision")
            if revision:
                by_revision.setdefault(revision, []).append(d.report.get("kpis") or {})
        m = self.metrics
        for gone in self._kpi_revisions.get(fleet, set()) - set(by_revision):
            for gauge in (
                m.revision_devices,
                m.revision_tokens,
                m.revision_errors,
                m.revision_ttft,
            ):
                with contextlib.suppress(KeyError):  # no device runs it any more
                    gauge.remove(fleet, gone)
        self._kpi_revisions[fleet] = set(by_revision)
        for revision, kpis in by_revision.items():
            m.revision_devices.labels(fleet, revision).set(len(kpis))
            m.revision_tokens.labels(fleet, revision).set(
                sum(k.get("tokensPerSecond", 0.0) for k in kpis)
            )
            requests = sum(k.get("requests", 0.0) for k in kpis)
            errors = sum(k.get("errorRate", 0.0) * k.get("requests", 0.0) for k in kpis)
            m.revision_errors.labels(fleet, revision).set(errors / requests if requests else 0.0)
            ttfts = sorted(k["ttftP95Seconds"] for k in kpis if "ttftP95Seconds" in k)
            if ttfts:
                m.revision_ttft.labels(fleet, revision).set(ttfts[len(ttfts) // 2])

    def _conditions(
        self, fleet: Fleet, st: crd.EdgeFleetStatus, problem: str | None, now: float
    ) -> list[crd.Condition]:
        generation = fleet.obj["metadata"].get("generation")
        rollout = st.rollout
        progressing = rollout is not None and rollout.phase == crd.FleetRolloutPhase.Progressing
        failed = rollout is not None and rollout.phase in (
            crd.FleetRolloutPhase.RolledBack, crd.FleetRolloutPhase.Stopped
        )  # fmt: skip
        ready = problem is None and st.config is not None and st.ready_devices > 0
        wanted = fleet.spec.expected_devices if fleet.spec else 0
        if wanted and st.ready_devices < wanted:
            ready = False
        conds = [
            ("Ready", ready, "DevicesReady" if ready else "DevicesNotReady",
             f"{st.ready_devices} of {st.devices} devices serve {st.current_revision}"),
            ("Progressing", progressing, "RolloutInProgress" if progressing else "Settled",
             rollout.message if rollout is not None else ""),
            ("Degraded", bool(problem) or failed,
             "ConfigUnavailable" if problem else ("RolloutFailed" if failed else "AsExpected"),
             problem or (rollout.message if failed and rollout else "")),
        ]  # fmt: skip
        old = {c.type: c for c in st.conditions}
        out = []
        for type_, value, reason, message in conds:
            status = crd.ConditionStatus.true if value else crd.ConditionStatus.false
            prev = old.get(type_)
            since = prev.last_transition_time if prev and prev.status == status else None
            out.append(crd.Condition(
                type=type_, status=status, reason=reason, message=message,
                last_transition_time=since or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                observed_generation=generation,
            ))  # fmt: skip
        return out

    async def _write_fleet(
        self, fleet: Fleet, st: crd.EdgeFleetStatus, now: float, problem: str | None
    ) -> None:
        st.conditions = self._conditions(fleet, st, problem, now)
        st.observed_generation = fleet.obj["metadata"].get("generation")
        wire = st.model_dump(mode="json", by_alias=True)
        steady = {k: v for k, v in wire.items() if k != "oldestHeartbeatSeconds"}
        last = {k: v for k, v in fleet.written.items() if k != "oldestHeartbeatSeconds"}
        # Counts and the rollout at once; the heartbeat age alone every 30 s.
        if (steady == last and now - fleet.written_at < 30) or not self.leading:
            return
        # A merge patch merges maps: a key gone (a revision no device runs any more) must be
        # sent as null, against what the API server holds (as last seen, and written since).
        stored = {**(fleet.obj.get("status") or {}), **fleet.written}
        patch = _with_nulls(stored, wire)
        await asyncio.to_thread(self.kube.patch_status, "EdgeFleet", fleet.name, patch)
        fleet.written, fleet.written_at = wire, now

    def _refresh(self, fleet: Fleet, d: Device, now: float) -> None:
        """Recompute a device's recorded status; mark it for writing when it changed."""
        assert fleet.spec is not None
        st, report = d.status, d.report
        online = d.online(now, fleet.spec.heartbeat_timeout_seconds)
        want = self.desired(fleet, d)
        running = report.get("configVersion", st.get("configVersion"))
        failed = report.get("failedVersion", st.get("failedVersion"))
        healthy = bool(report.get("healthy", st.get("healthy"))) and online
        if d.revoked:
            phase = crd.DevicePhase.Revoked
        elif not d.approved:
            phase = crd.DevicePhase.Pending
        elif not report and st.get("phase") in (None, "Pending"):
            phase = crd.DevicePhase.Approved
        elif not online:
            phase = crd.DevicePhase.Offline
        elif want is not None and (running or 0) < want.version and failed != want.version:
            phase = crd.DevicePhase.Updating
        elif healthy:
            phase = crd.DevicePhase.Ready
        else:
            phase = crd.DevicePhase.Approved
        new = {
            **st,
            "phase": phase.value,
            "revision": report.get("revision", st.get("revision")),
            "configVersion": running,
            "failedVersion": failed,
            "endpoint": report.get("endpoint", st.get("endpoint")),
            "healthy": healthy,
            "message": report.get("message", st.get("message", "")),
        }
        changed = [k for k in _RECORDED if new.get(k) != d.status.get(k)]
        if changed:
            log.debug("EdgeDevice %s: %s changed", d.name, ", ".join(changed))
            if d.last_seen is not None:
                new["lastSeen"] = round(d.last_seen, 3)
            d.status = new
            self.dirty.add(d.name)

    async def flush(self, workers: int = 8) -> None:
        """Write the changed device records, ``workers`` at a time, until none is left; a
        record changed again while it waits is written once, as it is then."""

        async def worker() -> None:
            while self.dirty:
                name = self.dirty.pop()
                device = self.devices.get(name)
                if device is None:
                    continue
                self.writing += 1
                try:
                    await asyncio.to_thread(
                        self.kube.patch_status, "EdgeDevice", name, dict(device.status)
                    )
                except Exception as exc:  # noqa: BLE001 - the API server: try again soon
                    log.warning("status of EdgeDevice %s not written: %s", name, exc)
                    self.dirty.add(name)
                    await asyncio.sleep(1.0)
                finally:
                    self.writing -= 1

        await asyncio.gather(*(worker() for _ in range(workers)))

    # ------------------------------------------------------------------ the device API

    def app(self) -> web.Application:
        """The device API (``api.DeviceAPI``) on this server's state."""
        return api.DeviceAPI(self).app()


def _with_nulls(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` as a JSON merge patch over ``old``: each map key of ``old`` that ``new``
    lacks is set to null (removed), at every depth."""
    out = dict(new)
    for key, value in old.items():
        if key not in new:
            out[key] = None
        elif isinstance(value, dict) and isinstance(new[key], dict):
            out[key] = _with_nulls(value, new[key])
    return out


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
    server.start_informers()
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    await site.start()
    log.info("fleet server for namespace %s on %s://%s:%d", namespace,
             "https" if tls else "http", host, port)  # fmt: skip
    for informer in server._informers:
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
        if not server.leading and server._digest_parts:
            await server._write_digest([])  # gone: the leader need not wait it out
        server.stop_informers()
        await runner.cleanup()
