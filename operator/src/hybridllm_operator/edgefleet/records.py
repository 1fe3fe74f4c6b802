"""What the fleet server knows of each fleet and device (in memory, rebuilt from the
records it watches)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import crd
from hybridllm_operator.edgefleet import waves


@dataclass
class Device:
    """One EdgeDevice as the server knows it: its record and its last heartbeat."""

    name: str
    fleet: str
    public_key: Any
    labels: dict[str, str]
    approved: bool
    revoked: bool
    invite: crd.DeviceInvite | None = None  # an administrator's invitation (hash of its token)
    status: dict[str, Any] = field(default_factory=dict)  # as last written (camelCase)
    last_seen: float | None = None
    report: dict[str, Any] = field(default_factory=dict)  # last heartbeat body
    heard_at: float | None = None  # when the device sent `report` (this replica's clock)
    heard_here: bool = False  # `report` came to this replica, not from another's digest

    def online(self, now: float, timeout: float) -> bool:
        return self.last_seen is not None and now - self.last_seen <= timeout


@dataclass
class Fleet:
    name: str
    obj: dict[str, Any]
    spec: crd.EdgeFleetSpec | None
    status: crd.EdgeFleetStatus
    problem: str | None = None
    key: Any = None
    ca: tuple[str, str] | None = None  # (the key's id, the CA certificate made from it)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    written: dict[str, Any] = field(default_factory=dict)
    written_at: float = 0.0
    # each device group's request rate in bins (`waves.DemandHistory`): plans the waves
    demand: dict[str, waves.DemandHistory] = field(default_factory=dict)
    sampled_at: float = 0.0
    handled_action: str | None = None  # the hand command acted on (until it is removed)
    # the sites' stranded demand (`StatusBuilder.stranded`): (device, minute) -> (prompt,
    # completion) tokens, "" for what an earlier leader wrote in the status; and the
    # heartbeat of each device last folded in (its time)
    stranded: dict[tuple[str, int], tuple[float, float]] | None = None
    stranded_folded: dict[str, float] = field(default_factory=dict)

    def device_ca(self, namespace: str) -> str:
        """The fleet's CA certificate (``device_tls``), made once per signing key."""
        assert self.key is not None
        from hybridllm_common import device_tls, signing

        key_id = signing.key_id(self.key)
        if self.ca is None or self.ca[0] != key_id:
            self.ca = (key_id, device_tls.ca_certificate(self.key, self.name, namespace))
        return self.ca[1]
