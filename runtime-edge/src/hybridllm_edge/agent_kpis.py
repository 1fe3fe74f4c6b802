"""The agent's heartbeat body: what it runs, and the serving KPIs read from the runtime.

``Kpis`` turns two reads of the runtime's /metrics (one a heartbeat) into the interval's
tokens/s, requests, error rate and TTFT p95, and the queue depth; ``heartbeat_body`` asks
the running runtime its /health and /metrics on loopback and puts them beside the config
version, the failed one and the agent's message. Sent by ``agent.Agent.heartbeat``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from hybridllm_edge.agent_runtime import Runtime


@dataclass
class Kpis:
    """Serving KPIs over the last heartbeat interval, from two reads of /metrics."""

    last: dict[str, float] = field(default_factory=dict)
    ttft: dict[float, float] = field(default_factory=dict)
    at: float = 0.0

    def update(self, text: str, now: float) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = {}
        buckets: dict[float, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "hybridllm_generation_tokens_total":
                    values["tokens"] = s.value
                elif s.name == "hybridllm_requests_total":
                    values["finished"] = values.get("finished", 0.0) + s.value
                elif s.name == "hybridllm_requests_rejected_total":
                    values["rejected"] = values.get("rejected", 0.0) + s.value
                elif s.name == "hybridllm_num_requests_waiting":
                    values["waiting"] = s.value
                elif s.name == "hybridllm_time_to_first_token_seconds_bucket":
                    buckets[float(s.labels["le"])] = s.value
        out: dict[str, float] = {"queueDepth": values.get("waiting", 0.0)}
        if self.last and now > self.at:
            span = now - self.at
            d = {k: max(0.0, values.get(k, 0.0) - self.last.get(k, 0.0)) for k in values}
            out["tokensPerSecond"] = round(d.get("tokens", 0.0) / span, 3)
            total = d.get("finished", 0.0) + d.get("rejected", 0.0)
            out["requests"] = total
            out["errorRate"] = round(d.get("rejected", 0.0) / total, 4) if total else 0.0
            window = {le: max(0.0, c - self.ttft.get(le, 0.0)) for le, c in buckets.items()}
            count = window.get(float("inf"), 0.0)
            if count:
                out["ttftP95Seconds"] = next(
                    le for le, c in sorted(window.items()) if c >= 0.95 * count
                )
                if out["ttftP95Seconds"] == float("inf"):
                    out["ttftP95Seconds"] = max(le for le in window if le != float("inf"))
        self.last, self.ttft, self.at = values, buckets, now
        return out


async def heartbeat_body(
    running: Runtime | None,
    kpis: Kpis,
    version: int,
    failed_version: int | None,
    message: str,
    site_gateway: str | None = None,
    stranded: list[list[float]] | None = None,
) -> bytes:
    """The heartbeat's JSON: the config running (or none), the one that failed, the agent's
    message, the site gateway it runs (its address) and the minutes of demand it stranded
    (``agent_stranded``), and, from the running runtime, its revision, endpoint, health and
    KPIs."""
    report: dict[str, Any] = {
        "configVersion": version or None,
        "failedVersion": failed_version,
        "message": message[:512],
        "healthy": False,
    }
    if site_gateway:
        report["siteGateway"] = site_gateway
    if stranded:
        report["strandedDemand"] = stranded
    if running is not None:
        report["revision"] = running.payload["revision"]
        report["endpoint"] = running.url
        try:
            async with running.client(5) as http:
                health = await http.get("/health")
                report["healthy"] = health.status_code == 200
                metrics = await http.get("/metrics")
            report["kpis"] = kpis.update(metrics.text, time.monotonic())
        except httpx.HTTPError:
            pass
    return json.dumps(report).encode()
