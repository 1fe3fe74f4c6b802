"""The leader's writes of the records: device statuses in the background, fleet statuses
when they change.

A device's record is marked ``dirty`` when something in it changes (the planner decides
what); ``RecordWriter`` writes the marked ones a few at a time, so a tick never waits for
them and a record that changes again before its turn is written once. A fleet's status is
written when its counts or its rollout change, its heartbeat age alone every 30 s, as a
JSON merge patch that removes the keys gone (``_with_nulls``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hybridllm_common import crd
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet.records import Fleet
from hybridllm_operator.edgefleet.state import FleetState

log = logging.getLogger(__name__)


class RecordWriter:
    """The writes of the records the leader keeps (none while it does not lead)."""

    def __init__(self, kube: kube_mod.Kube, state: FleetState) -> None:
        self.kube, self.state = kube, state
        self.dirty: set[str] = set()  # devices whose record changed, not yet taken
        self.writing = 0  # records taken from dirty, not yet sent

    def forget(self) -> None:
        """Hand-over: what was not written is the new leader's to write."""
        self.dirty.clear()
        for fleet in self.state.fleets.values():
            fleet.written, fleet.written_at = {}, 0.0

    async def run(self, tick_s: float) -> None:
        """Write changed device records in the background: a tick never waits for them,
        and a record that changes again before its turn is written once."""
        while True:
            if self.dirty and self.state.leading:
                await self.flush()
            else:
                await asyncio.sleep(tick_s / 2)

    async def flush(self, workers: int = 8) -> None:
        """Write the changed device records, ``workers`` at a time, until none is left; a
        record changed again while it waits is written once, as it is then."""

        async def worker() -> None:
            while self.dirty:
                name = self.dirty.pop()
                device = self.state.devices.get(name)
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

    async def write_fleet(self, fleet: Fleet, st: crd.EdgeFleetStatus, now: float) -> None:
        """The fleet's status, when it changed (or its heartbeat age, every 30 s)."""
        wire = st.model_dump(mode="json", by_alias=True)
        steady = {k: v for k, v in wire.items() if k != "oldestHeartbeatSeconds"}
        last = {k: v for k, v in fleet.written.items() if k != "oldestHeartbeatSeconds"}
        # Counts and the rollout at once; the heartbeat age alone every 30 s.
        if (steady == last and now - fleet.written_at < 30) or not self.state.leading:
            return
        # A merge patch merges maps: a key gone (a revision no device runs any more) must be
        # sent as null, against what the API server holds (as last seen, and written since).
        stored = {**(fleet.obj.get("status") or {}), **fleet.written}
        patch = _with_nulls(stored, wire)
        await asyncio.to_thread(self.kube.patch_status, "EdgeFleet", fleet.name, patch)
        fleet.written, fleet.written_at = wire, now


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
