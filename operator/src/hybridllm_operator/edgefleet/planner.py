"""The leader's tick over one fleet: its waves planned, each device's assignment and
recorded status decided, the fleet's status built.

``Planner.tick_fleet`` follows the fleet's LLMService: the content devices should run
comes from the service's edge tier (``FleetState.content``), and :func:`waves.plan` moves
a new revision through the fleet wave by wave, from the demand each device group showed
(sampled here) and the hand commands on the fleet (its annotation). ``Planner.refresh``
decides a device's phase and marks its record for the ``RecordWriter`` when it changed.
``StatusBuilder`` counts the fleet's devices into its status, exports their KPIs per
revision on /metrics and sets the status's conditions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from typing import Any

from hybridllm_common import crd, signing
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet import waves
from hybridllm_operator.edgefleet.metrics import Metrics
from hybridllm_operator.edgefleet.records import Device, Fleet
from hybridllm_operator.edgefleet.state import FleetState
from hybridllm_operator.edgefleet.writer import RecordWriter
from hybridllm_operator.llmservice import rollout

log = logging.getLogger(__name__)

# Fields of a device's status the server writes when they change (not lastSeen alone).
_RECORDED = ("phase", "revision", "configVersion", "assignedVersion", "assignedWave",
             "failedVersion", "endpoint", "healthy", "message")  # fmt: skip

DEMAND_BIN_S = 600.0  # the bins of each device group's demand history
STRANDED_SKEW_S = 300  # a stranded minute this far past the server's clock still counts
DEMAND_SAMPLE_S = 15.0  # how often a group's request rate is sampled (at most)


class Planner:
    """What the leader decides each tick, fleet by fleet."""

    def __init__(
        self,
        kube: kube_mod.Kube,
        state: FleetState,
        writer: RecordWriter,
        metrics: Metrics,
        demand_bin_s: float = DEMAND_BIN_S,
    ) -> None:
        self.kube, self.state, self.writer = kube, state, writer
        self.demand_bin_s = demand_bin_s
        self.status = StatusBuilder(state, metrics)

    async def tick_fleet(self, fleet: Fleet, now: float) -> None:
        if fleet.spec is None:
            await self._write_fleet(fleet, fleet.status, now, fleet.problem)
            return
        if fleet.key is None:
            fleet.key, refused = await asyncio.to_thread(
                self.kube.signing_key_or_problem, fleet.obj
            )
            if fleet.key is None:
                await self._write_fleet(fleet, fleet.status, now, refused)
                return
        content, problem = self.state.content(fleet)
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
        status.device_ca = fleet.device_ca(self.state.namespace)
        for name, (version, wave) in planned.assign.items():
            device = self.state.devices[name]
            device.status.update(
                {"assignedVersion": version, "assignedWave": wave, "assignedAt": round(now, 3)}
            )
            self.writer.dirty.add(name)
        self.status.count(fleet, status, now)
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
            self.state.wake(fleet)
        for d in self.state.devices.values():
            if d.fleet == fleet.name:
                self.refresh(fleet, d, now)
        await self._write_fleet(fleet, status, now, problem)

    def views(self, fleet: Fleet, now: float) -> list[waves.DeviceView]:
        assert fleet.spec is not None
        timeout = fleet.spec.heartbeat_timeout_seconds
        out = []
        for d in self.state.devices.values():
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
            d for d in self.state.devices.values()
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

    async def _write_fleet(
        self, fleet: Fleet, st: crd.EdgeFleetStatus, now: float, problem: str | None
    ) -> None:
        st.conditions = self.status.conditions(fleet, st, problem, now)
        st.observed_generation = fleet.obj["metadata"].get("generation")
        await self.writer.write_fleet(fleet, st, now)

    def refresh(self, fleet: Fleet, d: Device, now: float) -> None:
        """Recompute a device's recorded status; mark it for writing when it changed."""
        assert fleet.spec is not None
        st, report = d.status, d.report
        online = d.online(now, fleet.spec.heartbeat_timeout_seconds)
        want = self.state.desired(fleet, d)
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
            self.writer.dirty.add(d.name)


class StatusBuilder:
    """A fleet's status from its devices: counts, conditions, and the gauges of
    ``Metrics`` that go with them (exported by the leader only)."""

    def __init__(self, state: FleetState, metrics: Metrics) -> None:
        self.state, self.metrics = state, metrics
        self._kpi_revisions: dict[str, set[str]] = {}
        self._sites: dict[str, set[str]] = {}  # each fleet's sites on /metrics

    def forget(self) -> None:
        """Hand-over: the new leader exports the gauges."""
        m = self.metrics
        for gauge in (m.devices, m.revision_devices, m.revision_tokens, m.revision_errors,
                      m.revision_ttft, m.heartbeat_age, m.site_stranded):  # fmt: skip
            gauge.clear()
        self._kpi_revisions.clear()
        self._sites.clear()
        for fleet in self.state.fleets.values():  # a next takeover starts from the status
            fleet.stranded = None

    def count(self, fleet: Fleet, st: crd.EdgeFleetStatus, now: float) -> None:
        assert fleet.spec is not None
        timeout = fleet.spec.heartbeat_timeout_seconds
        members = [d for d in self.state.devices.values() if d.fleet == fleet.name]
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

        def ready(d: Device) -> bool:
            return bool(d.report.get("healthy", d.status.get("healthy"))) and (
                d.report.get("revision", d.status.get("revision")) == current_rev
            )

        st.ready_devices = sum(1 for d in online if ready(d))
        st.stranded_demand = self.stranded(fleet, members, now)
        st.sites = []
        stranded: dict[str, float] = {}  # device -> its prompt tokens stranded, last day
        for (name, _), (prompt, _) in (fleet.stranded or {}).items():
            stranded[name] = stranded.get(name, 0.0) + prompt
        if fleet.spec.sites is not None:  # each site: its devices, ready ones, gateways
            label, live = fleet.spec.sites.label, {d.name for d in online}
            for site in sorted({d.labels[label] for d in approved if d.labels.get(label)})[:1000]:
                here = [d for d in approved if d.labels.get(label) == site]
                gateways = [d.report["siteGateway"] for d in here
                            if d.name in live and d.report.get("siteGateway")]  # fmt: skip
                st.sites.append(crd.SiteStatus(
                    name=site, devices=len(here),
                    ready_devices=sum(1 for d in here if d.name in live and ready(d)),
                    gateways=sorted(gateways)[:64],
                    stranded_prompt_tokens=round(sum(stranded.get(d.name, 0.0) for d in here), 3),
                ))  # fmt: skip
        self._site_gauges(fleet.name, st.sites)
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

    def stranded(self, fleet: Fleet, members: list[Device], now: float) -> list[crd.StrandedBin]:
        """The minutes of demand the fleet's site gateways stranded (``strandedDemand`` in
        their heartbeats), summed over devices. Folding is idempotent: a device's minute is
        replaced, never added to, so a report read again (from a follower's digest) counts
        once. A new leader starts from the status its predecessor wrote; a report it holds
        from before (heard by the predecessor too) is taken as already in that status."""
        if fleet.stranded is None:
            fleet.stranded = {
                ("", b.start): (b.prompt_tokens, b.completion_tokens)
                for b in fleet.status.stranded_demand
            }
            fleet.stranded_folded = {d.name: d.heard_at or 0.0 for d in members}
        for d in members:
            heard = d.heard_at or 0.0
            if heard <= fleet.stranded_folded.get(d.name, -1.0):
                continue
            fleet.stranded_folded[d.name] = heard
            for start, prompt, completion in d.report.get("strandedDemand") or ():
                fleet.stranded[(d.name, int(start))] = (float(prompt), float(completion))
        # the last day's minutes: older ones go, and so do ones a device's clock put more
        # than a few minutes ahead of this server's
        oldest, newest = now - crd.STRANDED_KEEP_S, now + STRANDED_SKEW_S
        for key in [k for k in fleet.stranded if not oldest <= k[1] <= newest]:
            del fleet.stranded[key]
        minutes: dict[int, list[float]] = {}
        for (_, start), (prompt, completion) in fleet.stranded.items():
            total = minutes.setdefault(start, [0.0, 0.0])
            total[0] += prompt
            total[1] += completion
        return [
            crd.StrandedBin(start=start, prompt_tokens=round(p, 3), completion_tokens=round(c, 3))
            for start, (p, c) in sorted(minutes.items())
            if p > 0 or c > 0
        ][-(crd.STRANDED_KEEP_S // crd.STRANDED_BIN_S) :]

    def _site_gauges(self, fleet: str, sites: list[crd.SiteStatus]) -> None:
        gauge = self.metrics.site_stranded
        for gone in self._sites.get(fleet, set()) - {s.name for s in sites}:
            with contextlib.suppress(KeyError):
                gauge.remove(fleet, gone)
        for site in sites:
            gauge.labels(fleet=fleet, site=site.name).set(site.stranded_prompt_tokens)
        self._sites[fleet] = {s.name for s in sites}

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

    def conditions(
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
