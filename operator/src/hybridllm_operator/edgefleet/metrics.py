"""The fleet server's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridllm_common import metrics as names


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            names.FLEET_REQUESTS_TOTAL, "Device API calls by endpoint and status code.",
            ["endpoint", "code"], registry=r,
        )  # fmt: skip
        self.seconds = Histogram(
            names.FLEET_REQUEST_SECONDS, "Time to answer a device call (long polls "
            "excluded).", ["endpoint"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )  # fmt: skip
        self.devices = Gauge(
            names.FLEET_DEVICES, "Devices by fleet and phase.", ["fleet", "phase"],
            registry=r,
        )  # fmt: skip
        self.writes = _Writes(r)
        self.revision_devices = Gauge(
            names.FLEET_REVISION_DEVICES, "Online devices by fleet and revision.",
            ["fleet", "revision"], registry=r,
        )  # fmt: skip
        self.revision_tokens = Gauge(
            names.FLEET_REVISION_TOKENS_PER_SECOND,
            "Tokens per second the online devices of a revision generate, summed.",
            ["fleet", "revision"], registry=r,
        )  # fmt: skip
        self.revision_errors = Gauge(
            names.FLEET_REVISION_ERROR_RATE,
            "Share of a revision's device requests refused, weighted by requests.",
            ["fleet", "revision"], registry=r,
        )  # fmt: skip
        self.revision_ttft = Gauge(
            names.FLEET_REVISION_TTFT_P95_SECONDS,
            "Median over a revision's online devices of their TTFT p95.",
            ["fleet", "revision"], registry=r,
        )  # fmt: skip
        self.pending_writes = Gauge(
            names.FLEET_PENDING_WRITES, "Device records changed and not yet written.",
            registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            names.FLEET_REJECTED_TOTAL, "Calls refused, by reason.", ["reason"], registry=r
        )
        self.heartbeat_age = Gauge(
            names.FLEET_HEARTBEAT_AGE_SECONDS,
            "Seconds since the online devices of a fleet last heartbeat: the median "
            "(quantile 0.5) and the oldest (quantile 1).", ["fleet", "quantile"], registry=r,
        )  # fmt: skip
        self.site_stranded = Gauge(
            names.FLEET_SITE_STRANDED_PROMPT_TOKENS,
            "Prompt tokens a site's gateways refused over the last day because the cloud "
            "tier was unreachable from the site (reported once the WAN was back).",
            ["fleet", "site"], registry=r,
        )  # fmt: skip
        self.leader = Gauge(
            names.FLEET_LEADER, "1 on the replica that holds the Lease (plans waves, writes "
            "records, exports the fleet's gauges), 0 on the others.", registry=r,
        )  # fmt: skip
        self.digest_devices = Gauge(
            names.FLEET_DIGEST_DEVICES, "Devices in this replica's last heartbeat digest "
            "(heard by it, handed to the leader).", registry=r,
        )  # fmt: skip


class _Writes(Collector):
    """API-server writes since start, by kind: a counter read from `Kube.writes` (which
    counts them where they happen) at each scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counts: Callable[[], dict[str, int]] = dict
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            names.FLEET_API_WRITES_TOTAL.removesuffix("_total"),
            "API-server writes since start, by kind.", labels=["kind"],
        )  # fmt: skip
        for kind, count in sorted(self.counts().items()):
            family.add_metric([kind], count)
        yield family
