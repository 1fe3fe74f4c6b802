"""Prometheus metrics of one edge server, on a registry of its own (no globals).

The families both runtimes export are ``hybridllm_common.serving.metrics.ServerMetrics``
(the same names as the cloud runtime's); this adds the response cache's hit/miss counters
and entry gauge.
"""

from __future__ import annotations

from prometheus_client import Gauge

from hybridllm_common import metrics as names
from hybridllm_common.serving import metrics as serving_metrics


class ServerMetrics(serving_metrics.ServerMetrics):
    def __init__(self) -> None:
        super().__init__("Sequences per engine step")
        r = self.registry
        self.cache_hits = serving_metrics.counter(
            names.RESPONSE_CACHE_HITS_TOTAL, "Response cache hits", r
        )
        self.cache_misses = serving_metrics.counter(
            names.RESPONSE_CACHE_MISSES_TOTAL,
            "Cacheable requests not found in the response cache",
            r,
        )
        self.cache_entries = Gauge(
            names.RESPONSE_CACHE_ENTRIES, "Response cache entries", registry=r
        )
