"""How a fleet server replica shares the heartbeats it receives (the format is in
``digest.py``).

A follower writes what devices told it into its digest (ConfigMaps) every
``--digest-seconds`` when something new came, for the leader to merge
(``FleetState.merge``); the leader needs none of its own, deletes it at its takeover, and
deletes the digests of replicas gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from hybridllm_operator.edgefleet import digest as digests
from hybridllm_operator.edgefleet import kube as kube_mod
from hybridllm_operator.edgefleet.metrics import Metrics
from hybridllm_operator.edgefleet.state import FleetState

log = logging.getLogger(__name__)


class DigestSharing:
    """This replica's digest, and the leader's collection of the digests of replicas gone."""

    def __init__(
        self, kube: kube_mod.Kube, state: FleetState, metrics: Metrics, digest_s: float = 5.0
    ) -> None:
        self.kube, self.state, self.metrics, self.digest_s = kube, state, metrics, digest_s
        self.heard = False  # a device beat to this replica since its last digest
        self._names: set[str] = set()  # devices in the digest as last written
        self._at = 0.0  # when it was last written
        self._tasks: set[asyncio.Task[None]] = set()

    def take_over(self) -> None:
        """Leading: the leader's own heartbeats need no digest; its digest is deleted."""
        self._names, self.heard = set(), False
        self.write_soon([])

    async def follow(self, now: float) -> None:
        """A follower's digest, written when due and something in it is new."""
        if now - self._at < self.digest_s:
            return
        seen: dict[str, tuple[float, dict[str, Any]]] = {}
        for d in self.state.devices.values():
            its = self.state.fleets.get(d.fleet)
            keep = its.spec.heartbeat_timeout_seconds if its and its.spec else 120
            if d.heard_here and d.heard_at is not None and now - d.heard_at <= keep:
                seen[d.name] = (d.heard_at, d.report)
        if not self.heard and set(seen) == self._names:
            return  # nothing new: the leader's reading of the last digest still holds
        self.heard, self._names, self._at = False, set(seen), now
        self.metrics.digest_devices.set(len(seen))
        await self.write(digests.encode(self.state.identity, now, seen))

    def write_soon(self, parts: list[str]) -> None:
        if self.state.loop is not None:
            task = self.state.loop.create_task(self.write(parts))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def write(self, parts: list[str]) -> None:
        """This replica's digest as ``parts`` (none: deleted), older extra parts deleted."""
        identity = self.state.identity
        names = [digests.object_name(identity, i) for i in range(len(parts))]
        labels = {digests.LABEL: "true", digests.REPLICA_LABEL: digests.label_value(identity)}
        try:
            for name, text in zip(names, parts, strict=True):
                await asyncio.to_thread(
                    self.kube.write_config_map, name, labels, {digests.KEY: text}
                )
            for name in set(self.state.own_digest_parts) - set(names):
                await asyncio.to_thread(self.kube.delete_config_map, name)
            self.state.own_digest_parts = names
        except Exception as exc:  # noqa: BLE001 - the API server: the next period tries again
            log.warning("heartbeat digest of %s not written: %s", identity, exc)
            self.heard = True

    async def collect(self, now: float) -> None:
        """The leader deletes the digests of replicas gone: unchanged for twice the longest
        heartbeat timeout (nothing in them can make a device online any more)."""
        fleets = self.state.fleets.values()
        timeouts = [f.spec.heartbeat_timeout_seconds for f in fleets if f.spec]
        stale = 2 * max(timeouts, default=120)
        for name, (observed_at, found) in list(self.state.digests.items()):
            if now - observed_at > stale:
                log.info("deleting the heartbeat digest %s of replica %s, silent %.0f s",
                         name, found.replica, now - observed_at)  # fmt: skip
                self.state.digests.pop(name, None)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.kube.delete_config_map, name)
