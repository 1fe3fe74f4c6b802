"""Active probes of the tiers across a WAN from this gateway (a site gateway's cloud tier,
``remote`` in the routing table).

Passive ejection (balancer.py) learns that a backend is gone from requests that fail; over
a WAN that is down the failure is a connection that opens and then carries nothing, and
each request would wait out its first-byte timeout. So every ``probe_interval_s`` the
gateway asks each backend of a remote tier for ``/health`` (``probe_timeout_s`` each, all
at once): ``unreachable_after`` failures in a row make the backend unreachable (never
picked, not even in panic mode), one answer makes it reachable again. A request that needs
a tier none of whose backends is reachable is refused at once with 503 ``tier_unreachable``
and a ``Retry-After`` (proxy.py), while requests another tier may serve go there.
``hybridllm_gateway_tier_reachable{tier}`` is 1 or 0 for each remote tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from hybridllm_gateway import balancer as balancer_mod
from hybridllm_gateway import config as config_mod
from hybridllm_gateway import metrics as metrics_mod

log = logging.getLogger(__name__)


class Prober:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        tiers: Callable[[], dict[str, balancer_mod.TierPool]],
        settings: config_mod.GatewaySettings,
        metrics: metrics_mod.GatewayMetrics,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.session, self.tiers, self.settings = session, tiers, settings
        self.metrics, self.headers = metrics, headers or {}

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.settings.probe_interval_s)

    async def once(self) -> None:
        """Probe every backend of every remote tier once, at the same time."""
        pools = {name: pool for name, pool in self.tiers().items() if pool.remote}
        replicas = [r for pool in pools.values() for r in pool.replicas if r.weight > 0]
        await asyncio.gather(*(self._probe(r) for r in replicas))
        for name, pool in pools.items():
            self.metrics.tier_reachable.labels(tier=name).set(0 if pool.unreachable() else 1)

    async def _probe(self, replica: balancer_mod.Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.probe_timeout_s)
        headers = {} if replica.device else self.headers
        try:
            async with self.session.get(replica.url + "/health", timeout=timeout,
                                        headers=headers, **replica.connect) as resp:  # fmt: skip
                await resp.read()
                ok = resp.status < 500
        except (aiohttp.ClientError, TimeoutError, OSError):
            ok = False
        if ok:
            if replica.unreachable:
                log.warning("%s (tier %s) answers its probes again", replica.url, replica.tier)
            if replica.lost.is_set():
                replica.lost = asyncio.Event()
            replica.failed_probes, replica.unreachable = 0, False
            return
        replica.failed_probes += 1
        if not replica.unreachable and replica.failed_probes >= self.settings.unreachable_after:
            replica.unreachable, replica.unreachable_since = True, time.monotonic()
            replica.lost.set()
            log.warning("%s (tier %s) is unreachable: %d probes in a row failed", replica.url,
                        replica.tier, replica.failed_probes)  # fmt: skip
