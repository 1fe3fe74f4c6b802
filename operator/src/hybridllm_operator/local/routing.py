"""The local supervisor's routing: what a Service's endpoints do for pods, on one machine.

The gateway reads its routing table from a file (``Plan.routing_path``) and reloads it
when it changes. :class:`Routing` writes the operator's own table
(:func:`hybridllm_operator.llmservice.builders.routing_config`) with one backend per ready replica
(the readiness probes of :mod:`.processes` decide which), the canary's at the rollout's
weight, and rewrites it at each change: a replica that is not ready, or that is being
retired or restarted on a new spec, is out of it, and the gateway's own retries and
passive ejection cover the moments before the reload.

:func:`served_everywhere` is the check that the gateway serves what the table lists (its
``/metrics``): the service is "ready" only then (:meth:`Routing.until_served`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from hybridllm_common import metrics as names
from hybridllm_operator.llmservice import builders
from hybridllm_operator.local.files import atomic_write
from hybridllm_operator.local.plan import Plan
from hybridllm_operator.local.processes import Processes


def served_everywhere(metrics_text: str, routed: dict[str, int]) -> bool:
    """Whether a gateway's metrics show, per tier, at least the backends a routing table
    lists (``hybridllm_gateway_revision_healthy_backends``, summed over revisions)."""
    from prometheus_client.parser import text_string_to_metric_families

    healthy: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == names.GATEWAY_REVISION_HEALTHY_BACKENDS:
                tier = sample.labels.get("tier", "")
                healthy[tier] = healthy.get(tier, 0.0) + sample.value
    return all(healthy.get(tier, 0.0) >= count for tier, count in routed.items())


class Routing:
    """The gateway's routing table, built from ``service()`` (the service as the
    operator's renderer sees it now) and the ready replicas of ``processes``.

    ``published`` is set once a first table is written (the gateway starts then: it
    refuses to start without a backend)."""

    def __init__(
        self,
        plan: Plan,
        processes: Processes,
        *,
        service: Callable[[], builders.Service],
        say: Callable[[str], None],
        published: asyncio.Event,
    ) -> None:
        self.path = Path(plan.routing_path)
        self.gateway_url = plan.gateway_url
        self.processes = processes
        self.service = service
        self.say = say
        self.published = published
        self.table: dict[str, Any] | None = None  # the table last written
        self.routed: dict[str, int] = {}  # backends per tier in the table last written

    def ready_urls(self, component: str, track: str | None) -> list[str]:
        return [
            p.replica.url
            for p in self.processes.procs
            if p.replica.component == component and p.replica.track == track
            and p.status == "ready"
        ]  # fmt: skip

    def update(self) -> None:
        """The operator's routing table (:func:`builders.routing_config`) with one backend
        per ready replica, the canary's at the rollout's weight."""
        service = self.service()
        stable = {
            tier: self.ready_urls(component, None)
            for tier, component in builders.tier_components(service).items()
        }
        canary = {}
        if service.canary is not None:
            canary = {
                tier: self.ready_urls(component, builders.CANARY)
                for tier, component in builders.tier_components(service, service.canary).items()
            }
        table = builders.routing_config(service, stable, canary)
        if table == self.table or not (any(stable.values()) or any(canary.values())):
            # No tier has a ready replica: keep the last table (the gateway's retries and
            # ejection handle dead backends) rather than one the gateway would refuse.
            return
        self.table = table
        self.routed = {
            t: len(stable.get(t, [])) + len(canary.get(t, [])) for t in {*stable, *canary}
        }
        atomic_write(self.path, json.dumps(table, indent=2, sort_keys=True) + "\n")
        if self.published.is_set():
            shown = {t: len(u) for t, u in stable.items()}
            shown |= {f"{t} (canary)": len(u) for t, u in canary.items()}
            self.say(f"routing table updated: ready replicas per tier {shown}")
        self.published.set()

    async def until_served(self, stop: asyncio.Event, timeout_s: float) -> None:
        """Until the gateway's metrics show as many healthy backends per tier as the
        table last written lists (:func:`served_everywhere`), the stop, or ``timeout_s``
        (a gateway that ejected a backend meanwhile must not hold a caller forever)."""
        deadline = time.monotonic() + timeout_s
        url = f"{self.gateway_url}/metrics"
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline and not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if served_everywhere(await r.text(), self.routed):
                            break
                await asyncio.sleep(0.1)
