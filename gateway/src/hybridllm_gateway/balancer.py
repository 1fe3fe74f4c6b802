"""Replica choice inside a tier: affinity by consistent hashing with bounded load, least
outstanding requests otherwise, canary weights, and passive outlier ejection.

With an affinity key (a session id, else the first ``prefix_chars`` of the prompt) the
replica is found on a hash ring, the way KubeAI's PrefixHash does it: each backend owns
virtual nodes in proportion to its weight; the key's hash is looked up on the ring and the
walk goes clockwise to the first replica that is healthy and whose outstanding requests
stay within ``load_factor`` times its fair share of the tier's load, counting this
request (Mirrokni et al., "Consistent Hashing with Bounded Loads"). A key therefore
sticks to one replica while it is not overloaded, so that replica's prefix cache stays
warm, and no replica carries more than ~1.25x the mean. The ring hashes with BLAKE2b, not
Python's per-process ``hash``, so every gateway replica maps a key to the same backend.

Without a key the replica with the fewest outstanding requests per unit of weight wins,
ties broken at random in proportion to weight. A weight of 0 drains a backend.

Weights split traffic between model revisions (a canary rollout): every backend of a
revision carries the revision's percent. When a tier has more than one revision with a
weight, the revision is chosen first, in proportion to the weights (by the session's
hash when there is one, so a session stays on one revision; at random otherwise), and the
replica is then chosen among that revision's; a revision with no replica left to try
gives way to the others.

Ejection is passive: ``eject_after_failures`` consecutive failures (connection errors,
timeouts, 5xx before the first byte) eject a replica for ``eject_base_s``, doubling on each
ejection in a row up to ``eject_max_s``. When the time is up the replica takes traffic
again; one more failure ejects it again for longer, one success clears the record. A tier
whose replicas are all ejected is picked from in full (panic mode): with one replica, an
ejection would otherwise turn a burst of connect timeouts into seconds of certain 502s.
The router still sees such a tier as down and spills away from it where it can.

A remote tier (across a WAN from this gateway) is also probed actively (probe.py): its
backends that fail ``unreachable_after`` probes in a row are unreachable, never picked, not
even in panic mode, until a probe answers again.

Replica state (outstanding count, failures) is kept by URL across routing reloads, so a
request in flight during a reload still decrements the right counter.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import math
import random
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import device_tls
from hybridllm_gateway import config as config_mod

RING_POINTS_PER_BACKEND = 160


def stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


@dataclass(eq=False)
class Replica:
    url: str
    tier: str
    revision: str = ""
    weight: int = 100
    device: bool = False  # outside the cluster: not sent the backend token
    num_outstanding: int = 0
    # prompt tokens of the streamed answers it has begun (each counted at its first token,
    # which ends its prefill): the speed estimate's stall term, the prefills an answer's
    # decoding shared the replica with (hybridllm_common.speed)
    prompt_tokens_prefilled: int = 0
    num_consecutive_failures: int = 0
    num_ejections_in_row: int = 0
    num_ejections: int = 0
    ejected_until: float = 0.0
    # a device over TLS: aiohttp's ssl and server_hostname for it (``tls_args``)
    connect: dict[str, Any] = field(default_factory=dict)
    unreachable: bool = False  # a remote tier's backend its probes cannot reach (probe.py)
    unreachable_since: float = 0.0
    # a backend of a remote tier: another gateway across a WAN (a site's cloud tier), told
    # which tier to answer from so that it does not route the request again
    remote: bool = False
    # set when its probes find it unreachable: the attempts waiting on it give up at once
    # instead of waiting out their first-byte timeout (a new Event once it answers again)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    failed_probes: int = 0

    def healthy(self, now: float) -> bool:
        return self.weight > 0 and now >= self.ejected_until and not self.unreachable


@dataclass
class Ring:
    points: list[int] = field(default_factory=list)
    owners: list[Replica] = field(default_factory=list)

    @classmethod
    def build(cls, replicas: list[Replica]) -> Ring:
        max_weight = max((r.weight for r in replicas), default=0)
        pairs: list[tuple[int, int]] = []
        for i, r in enumerate(replicas):
            if r.weight <= 0:
                continue
            vnodes = max(1, round(RING_POINTS_PER_BACKEND * r.weight / max_weight))
            pairs += [(stable_hash(f"{r.url}#{v}"), i) for v in range(vnodes)]
        pairs.sort()
        return cls([p for p, _ in pairs], [replicas[i] for _, i in pairs])


class TierPool:
    """The replicas of one tier and the ring over them."""

    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        load_factor: float,
        scale_from_zero: bool = False,
        remote: bool = False,
    ) -> None:
        self.name, self.replicas, self.load_factor = name, replicas, load_factor
        self.scale_from_zero, self.remote = scale_from_zero, remote
        self.ring = Ring.build(replicas)
        self.total_weight = sum(r.weight for r in replicas if r.weight > 0)

    def healthy(self, now: float | None = None) -> list[Replica]:
        now = time.monotonic() if now is None else now
        return [r for r in self.replicas if r.healthy(now)]

    def candidates(self, now: float) -> list[Replica]:
        """The healthy replicas or, when every one is ejected, all of them (panic mode, as
        Envoy does below its panic threshold): failing every request is never better."""
        return self.healthy(now) or [r for r in self.replicas if r.weight > 0 and not r.unreachable]

    def unreachable(self) -> bool:
        """A remote tier none of whose backends its probes reach."""
        live = [r for r in self.replicas if r.weight > 0]
        return self.remote and bool(live) and all(r.unreachable for r in live)

    def revision_weights(self) -> dict[str, int]:
        """Revision -> its weight (the largest of its backends')."""
        out: dict[str, int] = {}
        for r in self.replicas:
            out[r.revision] = max(out.get(r.revision, 0), r.weight)
        return out

    def _revision_candidates(self, key: str | None, candidates: list[Replica]) -> list[Replica]:
        """The candidates of one revision, chosen by weight, when several revisions have one."""
        weights: dict[str, int] = {}
        for r in candidates:
            weights[r.revision] = max(weights.get(r.revision, 0), r.weight)
        if len(weights) < 2:
            return candidates
        revisions = sorted(weights)
        total = sum(weights.values())
        if key is not None and key.startswith("s:"):  # a session stays on one revision;
            point = stable_hash("revision#" + key) % total  # a shared prompt prefix must not
            for revision in revisions:
                point -= weights[revision]
                if point < 0:
                    break
        else:
            revision = random.choices(revisions, weights=[weights[v] for v in revisions])[0]
        return [r for r in candidates if r.revision == revision]

    def least_outstanding(self, now: float | None = None) -> int | None:
        """The fewest outstanding requests on a healthy replica (None: none is healthy)."""
        healthy = self.healthy(now)
        return min((r.num_outstanding for r in healthy), default=None)

    def overloaded(self, max_outstanding: int) -> bool:
        """True when every healthy replica already has more than ``max_outstanding``."""
        healthy = self.healthy()
        return bool(healthy) and all(r.num_outstanding > max_outstanding for r in healthy)

    def pick(
        self, key: str | None, exclude: set[str] | frozenset[str] = frozenset()
    ) -> Replica | None:
        now = time.monotonic()
        candidates = [r for r in self.candidates(now) if r.url not in exclude]
        if not candidates:
            return None
        candidates = self._revision_candidates(key, candidates)
        if len(candidates) == 1:
            return candidates[0]
        if key is not None:
            chosen = self._pick_hashed(key, candidates)
            if chosen is not None:
                return chosen
        return self._pick_least(candidates)

    def _pick_hashed(self, key: str, candidates: list[Replica]) -> Replica | None:
        allowed = set(map(id, candidates))
        total = sum(r.num_outstanding for r in candidates) + 1
        weight = sum(r.weight for r in candidates)
        points, owners = self.ring.points, self.ring.owners
        if not points:
            return None
        start = bisect.bisect_left(points, stable_hash(key)) % len(points)
        seen: set[int] = set()
        for step in range(len(points)):
            r = owners[(start + step) % len(points)]
            if id(r) in seen or id(r) not in allowed:
                continue
            seen.add(id(r))
            bound = math.ceil(self.load_factor * total * r.weight / weight)
            if r.num_outstanding + 1 <= bound:
                return r
            if len(seen) == len(allowed):
                break
        return None

    @staticmethod
    def _pick_least(candidates: list[Replica]) -> Replica:
        best = min(r.num_outstanding / r.weight for r in candidates)
        ties = [r for r in candidates if r.num_outstanding / r.weight == best]
        if len(ties) == 1:
            return ties[0]
        return random.choices(ties, weights=[r.weight for r in ties])[0]


@functools.lru_cache(maxsize=8)
def _device_context(ca_pem: str) -> ssl.SSLContext:
    return device_tls.client_context(ca_pem)


def tls_args(ca_pem: str, server_name: str) -> dict[str, Any]:
    """aiohttp's arguments for a device backend over TLS (``device_tls``): trust its
    fleet's CA alone, and verify the certificate names the device meant. None for others."""
    if not server_name:
        return {}
    return {"ssl": _device_context(ca_pem), "server_hostname": server_name}


class Balancer:
    """All tiers; rebuilt from each routing table, replica state kept by URL."""

    def __init__(self, settings: config_mod.GatewaySettings) -> None:
        self.settings = settings
        self.by_url: dict[tuple[str, str], Replica] = {}
        self.tiers: dict[str, TierPool] = {}

    def update(self, routing: config_mod.RoutingConfig) -> None:
        tiers: dict[str, TierPool] = {}
        for name, tier in routing.tiers.items():
            replicas = []
            for b in tier.backends:
                r = self.by_url.get((name, b.url)) or Replica(url=b.url.rstrip("/"), tier=name)
                r.revision, r.weight, r.device = b.revision, b.weight, b.device
                r.remote = tier.remote
                r.connect = tls_args(routing.device_ca, b.server_name)
                self.by_url[(name, b.url)] = r
                replicas.append(r)
            tiers[name] = TierPool(
                name, replicas, self.settings.load_factor, tier.scale_from_zero, tier.remote
            )
        self.tiers = tiers

    def record_success(self, r: Replica) -> None:
        r.num_consecutive_failures = 0
        r.num_ejections_in_row = 0

    def record_failure(self, r: Replica) -> bool:
        """Counts a failure; True when it ejected the replica."""
        r.num_consecutive_failures += 1
        if r.num_consecutive_failures < self.settings.eject_after_failures:
            return False
        s = self.settings
        # the back-off doubles up to its cap; the exponent is bounded too (a replica whose
        # in-flight requests all time out counts thousands: 2**1100 is no float)
        duration = min(s.eject_base_s * 2 ** min(r.num_ejections_in_row, 62), s.eject_max_s)
        r.ejected_until = time.monotonic() + duration
        r.num_ejections_in_row += 1
        r.num_ejections += 1
        return True
