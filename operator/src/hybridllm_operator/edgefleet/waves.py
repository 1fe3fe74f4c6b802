"""What each device of a fleet should run, and how a new revision moves through the fleet.

Pure functions of the fleet's spec and status and of what the devices reported: the fleet
server calls :func:`plan` every tick and writes what it returns; tests call it with made-up
devices and clocks.

The fleet hands out at most two configs at a time, each a :class:`crd.FleetConfig` with a
monotonic version: ``config`` (the revision the fleet should run) and, while a rollout
goes through its waves, ``previous_config`` (what the devices outside the waves keep). A
device joins a wave when the planner *assigns* it the new version (written on its
record, with the wave's index, so a restarted server finds the same waves). A rollback
does not hand out an old document: the previous content is signed again under a new,
higher version, so that devices, which refuse any version lower than the one they run,
accept it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hybridllm_common import crd, signing
from hybridllm_forecaster import windows
from hybridllm_operator.llmservice import builders, rollout

Phase = crd.FleetRolloutPhase
Event = tuple[str, str, str]  # type (Normal, Warning), reason, message


def heartbeat_seconds(fleet: crd.EdgeFleetSpec) -> int:
    """How often a device of the fleet beats (its KPIs count over that interval)."""
    return max(3, fleet.heartbeat_timeout_seconds // 3)


def config_content(
    service_name: str, spec: crd.LLMServiceSpec, fleet: crd.EdgeFleetSpec
) -> dict[str, Any]:
    """What a device of this fleet should run for this LLMService spec: the part of the
    signed document that is the same for every device (the server adds the device, the
    version and the validity)."""
    edge = spec.edge
    cache = edge.response_cache
    return {
        "revision": spec.model.revision,
        "model": {
            "uri": spec.model.source,
            "sha256": spec.model.sha256,
            "servedName": spec.model.served_name or service_name,
            "runtime": edge.runtime.value,
            "quantization": edge.quantization.value,
            "contextLength": spec.model.context_length,
        },
        "runtime": {
            "parallel": edge.parallel,
            "cache": {"ttlSeconds": cache.ttl_seconds, "maxEntries": cache.max_entries}
            if cache.enabled
            else None,
        },
        "healthCheck": fleet.health_check.to_wire(),
        "heartbeatSeconds": heartbeat_seconds(fleet),
        "pollSeconds": fleet.config_poll_seconds,
    }


def devices_target(service: builders.Service) -> crd.LLMServiceSpec:
    """The spec a service's edge devices should run: the newest revision it serves, its
    canary while a rollout has one (from the step that moves the devices, when a step
    names them), the stable one otherwise (an aborted revision is not sent)."""
    if service.canary is not None and rollout.devices_on_canary(service.rollout, service.spec):
        return service.canary
    return service.stable


def content_text(content: dict[str, Any]) -> str:
    return signing.canonical(content).decode()


def content_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class DeviceView:
    """What the planner needs to know about one approved member device."""

    name: str
    labels: dict[str, str]
    online: bool
    healthy: bool = False
    config_version: int | None = None  # what it runs
    assigned_version: int | None = None  # what a wave sent it
    assigned_wave: int | None = None
    assigned_at: float | None = None
    failed_version: int | None = None


@dataclasses.dataclass
class Plan:
    status: crd.EdgeFleetStatus
    # device -> (version, wave): devices that join the current wave now (written on records)
    assign: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    events: list[Event] = dataclasses.field(default_factory=list)


def desired(status: crd.EdgeFleetStatus, device: DeviceView) -> crd.FleetConfig | None:
    """The config a device should run: the previous one while a rollout has not reached it."""
    rollout = status.rollout
    if (
        rollout is not None
        and rollout.phase in (Phase.Progressing, Phase.Stopped)
        and status.previous_config is not None
        and status.config is not None
        and device.assigned_version != status.config.version
    ):
        return status.previous_config
    return status.config


def wave_count(fleet: crd.EdgeFleetSpec) -> int:
    """The spec's waves and the last one that takes every device the others left."""
    return len(fleet.rollout.waves) + 1


def wave_size(fleet: crd.EdgeFleetSpec, wave: int, members: int) -> int | None:
    """How many devices a wave takes (None: every device left that its labels match)."""
    if wave >= len(fleet.rollout.waves):
        return None
    spec = fleet.rollout.waves[wave]
    if spec.count is not None:
        return spec.count
    if spec.percent is not None:
        return max(1, math.ceil(members * spec.percent / 100))
    return None


def matches(labels: dict[str, str], want: dict[str, str] | None) -> bool:
    """Whether labels hold every key and value of ``want`` (None: any labels)."""
    return all(labels.get(k) == v for k, v in (want or {}).items())


def summary(status: crd.EdgeFleetStatus) -> str | None:
    rollout = status.rollout
    if rollout is None:
        return None
    if rollout.phase == Phase.Progressing:
        return f"Progressing wave {rollout.wave + 1}/{rollout.waves}"
    return rollout.phase.value


def group_key(labels: Mapping[str, str] | None) -> str:
    """A device group by the labels that pick it: ``k=v,k2=v2`` (sorted); ``""`` is
    every device of the fleet."""
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))


def wave_labels(fleet: crd.EdgeFleetSpec, wave: int) -> dict[str, str] | None:
    """The labels a wave picks its devices by (None: any device; the last wave)."""
    return fleet.rollout.waves[wave].match_labels if wave < len(fleet.rollout.waves) else None


def groups(fleet: crd.EdgeFleetSpec) -> dict[str, dict[str, str] | None]:
    """The device groups whose demand plans the waves: each wave's labels, and every
    device (the last wave, and a wave that names no labels)."""
    out: dict[str, dict[str, str] | None] = {"": None}
    for wave in fleet.rollout.waves:
        out[group_key(wave.match_labels)] = wave.match_labels
    return out


def wave_window(fleet: crd.EdgeFleetSpec) -> windows.Window | None:
    """``spec.rollout.window`` as the planner takes it (None: each wave starts at once)."""
    w = fleet.rollout.window
    return rollout.window_from(w) if w is not None else None


def plan(
    status: crd.EdgeFleetStatus,
    fleet: crd.EdgeFleetSpec,
    content: dict[str, Any] | None,
    devices: Sequence[DeviceView],
    now: float,
    profiles: Mapping[str, windows.DayProfile | None] | None = None,
    start_now: bool = False,
) -> Plan:
    """The fleet's next status and the devices that join a wave now; ``content`` is what
    the service asks devices to run (None: the service is missing or invalid, nothing
    changes). With ``spec.rollout.window``, a wave starts at the time planned for it
    from ``profiles`` (each device group's demand by time of day, by `group_key`), or
    at once with ``start_now`` (a hand command)."""
    out = Plan(status.model_copy(deep=True))
    if content is not None:
        _follow(out, content, now)
    st = out.status
    if st.rollout is not None and st.rollout.phase == Phase.Progressing:
        _advance(out, fleet, sorted(devices, key=lambda d: d.name), now, profiles or {},
                 start_now)  # fmt: skip
    st.current_revision = st.config.revision if st.config else None
    st.rollout_summary = summary(st)
    return out


def _issue(st: crd.EdgeFleetStatus, revision: str, text: str) -> crd.FleetConfig:
    st.config_version += 1
    return crd.FleetConfig(revision=revision, version=st.config_version, content=text)


def _follow(out: Plan, content: dict[str, Any], now: float) -> None:
    """Start a rollout when the service asks for other content than the fleet runs."""
    st, text = out.status, content_text(content)
    revision = str(content["revision"])
    if st.config is None:
        st.config = _issue(st, revision, text)
        out.events.append(("Normal", "ConfigIssued", f"devices run {revision}"))
        return
    if text == st.config.content:
        return
    rollout = st.rollout
    progressing = rollout is not None and rollout.phase == Phase.Progressing
    if (
        rollout is not None
        and rollout.phase in (Phase.RolledBack, Phase.Stopped)
        and rollout.to_content_sha256 == content_sha256(text)
    ):
        return  # what failed is not tried again until the service asks for something else
    if progressing and st.previous_config is not None and text == st.previous_config.content:
        _roll_back(out, now, f"{st.config.revision} withdrawn: the service asks for "
                             f"{revision} again")  # fmt: skip
        return
    previous = st.previous_config if progressing and st.previous_config else st.config
    st.previous_config = previous
    st.config = _issue(st, revision, text)
    st.rollout = crd.FleetRolloutStatus(
        phase=Phase.Progressing,
        from_revision=previous.revision,
        to_revision=revision,
        to_content_sha256=content_sha256(text),
        wave=0,
        waves=1,
        started_at=now,
        wave_started_at=now,
        message=f"{previous.revision} -> {revision}: wave 1",
    )
    out.events.append(("Normal", "FleetRolloutStarted", f"{previous.revision} -> {revision}"))


def _roll_back(out: Plan, now: float, why: str) -> None:
    st = out.status
    assert st.rollout is not None
    assert st.previous_config is not None
    back = st.previous_config
    st.config = _issue(st, back.revision, back.content)
    st.previous_config = None
    st.rollout = st.rollout.model_copy(update={"phase": Phase.RolledBack, "message": why})
    out.events.append(("Warning", "FleetRolledBack", why))


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _wave_waits(
    out: Plan,
    rollout: crd.FleetRolloutStatus,
    fleet: crd.EdgeFleetSpec,
    profiles: Mapping[str, windows.DayProfile | None],
    now: float,
    start_now: bool,
) -> tuple[crd.FleetRolloutStatus, bool]:
    """A wave that has sent no device the new config yet, under a window: (the rollout's
    status, whether the wave waits). Its start is planned at every look from its own
    devices' demand by time of day (the longest wait counting from when the wave came
    up), shown in ``waveStartsAt`` and the message; once that time came (or by hand) the
    wave goes on and is not planned again."""
    window = wave_window(fleet)
    k, waves = rollout.wave, rollout.waves
    planned_at = rollout.wave_starts_at
    waiting = f"wave {k + 1}/{waves} starts at "
    if window is None:
        return rollout, False
    if planned_at is not None and now >= planned_at:
        if rollout.message.startswith(waiting):  # it waited until now: say it goes
            why = f"wave {k + 1}/{waves}: its planned start came"
            out.events.append(("Normal", "FleetWaveStarted", why))
            return rollout.model_copy(update={"message": why}), False
        return rollout, False
    labels = wave_labels(fleet, k)
    who = f"the devices with {group_key(labels)}" if labels else "its devices"
    if start_now:
        why = f"wave {k + 1}/{waves} started by hand before its planned start"
        out.events.append(("Normal", "FleetWaveStarted", why))
        return rollout.model_copy(update={"wave_starts_at": now, "message": why}), False
    planned = windows.plan_start(
        now, float(fleet.rollout.update_timeout_seconds), window,
        profiles.get(group_key(labels)), since_s=rollout.wave_started_at,
    )  # fmt: skip
    if now >= planned.start_s:
        out.events.append(("Normal", "FleetWaveStarted", f"wave {k + 1}/{waves}: {planned.reason}"))
        return rollout.model_copy(update={"wave_starts_at": now}), False
    whose = f"the demand of {who}; " if window.below_peak is not None else ""
    message = (
        f"{waiting}{_utc(planned.start_s)}: {planned.reason} ({whose}`hybridllm fleet "
        "start` starts it now)"
    )
    if planned_at is None:
        out.events.append(("Normal", "FleetWaveScheduled", message))
    held = rollout.model_copy(update={"wave_starts_at": planned.start_s, "message": message})
    return held, True


def _advance(
    out: Plan,
    fleet: crd.EdgeFleetSpec,
    devices: list[DeviceView],
    now: float,
    profiles: Mapping[str, windows.DayProfile | None],
    start_now: bool,
) -> None:
    st = out.status
    rollout, config = st.rollout, st.config
    assert rollout is not None
    assert config is not None
    members = [d for d in devices if matches(d.labels, fleet.selector)]
    waves = wave_count(fleet)
    rollout = rollout.model_copy(update={"waves": waves})
    policy = fleet.rollout
    need = policy.success_threshold / 100
    while True:
        k = rollout.wave
        labels = policy.waves[k].match_labels if k < len(policy.waves) else None
        # Devices this wave may take: its labels, not taken by an earlier wave.
        matching = [
            d for d in members
            if matches(d.labels, labels)
            and (d.assigned_version != config.version or d.assigned_wave == k)
        ]  # fmt: skip
        size = wave_size(fleet, k, len(members))
        target = len(matching) if size is None else min(size, len(matching))
        in_wave = [d for d in matching if d.assigned_version == config.version]
        if not in_wave:
            rollout, waits = _wave_waits(out, rollout, fleet, profiles, now, start_now)
            if waits:
                st.rollout = rollout
                return
        outcome = {d.name: _outcome(d, config.version, policy, now) for d in in_wave}
        # Devices join up to the wave's size, at most maxUnavailable updating at once;
        # an offline device is not sent a config it cannot fetch.
        room = fleet.max_unavailable - sum(1 for o in outcome.values() if o == "updating")
        waiting = [d for d in matching if d.name not in outcome and d.online]
        joining = waiting[: max(0, min(room, target - len(outcome)))]
        for d in joining:
            out.assign[d.name] = (config.version, k)
            outcome[d.name] = "updating"
        filled = len(outcome) >= target or len(joining) == len(waiting)
        failed = sorted(n for n, o in outcome.items() if o == "failed")
        ok = sum(1 for o in outcome.values() if o == "ok")
        # A wave fails as soon as its failures alone keep it below the threshold.
        if failed and len(failed) > target * (1 - need) + 1e-9:
            _fail_wave(out, rollout, fleet, failed, now)
            return
        if not filled or any(o == "updating" for o in outcome.values()):
            st.rollout = rollout.model_copy(update={
                "message": f"wave {k + 1}/{waves}: {ok} of {target} devices updated",
                "failed_devices": failed[:100],
            })  # fmt: skip
            return
        judged = ok + len(failed)
        if judged and ok < need * judged - 1e-9:
            _fail_wave(out, rollout, fleet, failed, now)
            return
        if k + 1 >= waves:
            st.previous_config = None
            st.rollout = rollout.model_copy(update={
                "phase": Phase.Completed, "failed_devices": failed[:100],
                "message": f"{rollout.to_revision} on every device",
            })  # fmt: skip
            out.events.append(("Normal", "FleetRolloutCompleted", st.rollout.message))
            return
        out.events.append(("Normal", "FleetWaveCompleted",
                           f"wave {k + 1}/{waves}: {ok} of {judged} devices passed"))  # fmt: skip
        rollout = rollout.model_copy(
            update={"wave": k + 1, "wave_started_at": now, "wave_starts_at": None}
        )


def _outcome(d: DeviceView, version: int, policy: crd.FleetRollout, now: float) -> str:
    if d.config_version is not None and d.config_version >= version and d.healthy and d.online:
        return "ok"
    if d.failed_version == version:
        return "failed"
    if not d.online:
        return {
            crd.OfflineDevices.skip: "skipped",
            crd.OfflineDevices.fail: "failed",
            crd.OfflineDevices.wait: "updating",
        }[policy.offline_devices]
    if d.assigned_at is not None and now - d.assigned_at > policy.update_timeout_seconds:
        return "failed"
    return "updating"


def _fail_wave(
    out: Plan,
    rollout: crd.FleetRolloutStatus,
    fleet: crd.EdgeFleetSpec,
    failed: list[str],
    now: float,
) -> None:
    st = out.status
    why = (
        f"wave {rollout.wave + 1}/{rollout.waves} below {fleet.rollout.success_threshold}%: "
        f"{len(failed)} device(s) failed ({', '.join(failed[:5])}"
        f"{', ...' if len(failed) > 5 else ''})"
    )
    st.rollout = rollout.model_copy(update={"failed_devices": failed[:100]})
    if fleet.rollout.auto_rollback:
        _roll_back(out, now, f"{why}; every device goes back to {rollout.from_revision}")
        return
    st.rollout = st.rollout.model_copy(update={"phase": Phase.Stopped, "message": why})
    out.events.append(("Warning", "FleetRolloutStopped", why))


@dataclasses.dataclass
class DemandHistory:
    """One device group's request rate in bins of wall-clock time, up to a profile's
    week: what its waves are planned from. The fleet server adds the group's rate (the
    requests its online devices report per heartbeat interval, summed) at every sample;
    a bin's value is the mean of its samples; a bin with none (no leader was running)
    takes the bin before it."""

    bin_s: float = 600.0
    start_s: float | None = None  # when bin 0 began
    sums: list[float] = dataclasses.field(default_factory=list)
    counts: list[int] = dataclasses.field(default_factory=list)

    @property
    def max_bins(self) -> int:
        return int(windows.PROFILE_DAYS * windows.DAY_S / self.bin_s) + 1

    def add(self, t: float, rate: float) -> None:
        begins = math.floor(t / self.bin_s) * self.bin_s
        if self.start_s is None:
            self.start_s = begins
        i = round((begins - self.start_s) / self.bin_s)
        if i < 0:
            return
        while len(self.sums) <= i:
            self.sums.append(0.0)
            self.counts.append(0)
        self.sums[i] += rate
        self.counts[i] += 1
        drop = len(self.sums) - self.max_bins
        if drop > 0:
            del self.sums[:drop], self.counts[:drop]
            self.start_s += drop * self.bin_s

    def profile(self, now: float) -> windows.DayProfile | None:
        """The group's demand by time of day from the bins complete at ``now`` (None
        before a whole day of them)."""
        if self.start_s is None:
            return None
        n = min(len(self.sums), int((now - self.start_s) // self.bin_s))
        values, last = [], 0.0
        for s, c in zip(self.sums[:n], self.counts[:n], strict=True):
            last = s / c if c else last
            values.append(last)
        return windows.DayProfile.from_history(values, self.bin_s, self.start_s)
