"""Demand read from the gateways' own ``/metrics`` (local mode, or a cluster without
Prometheus): `GatewayScrape`.

Rates come from the counters' increase between two scrapes, summed over the gateway
replicas, and the history from `Bins` it accumulates in memory. `scrape` reads one
replica over a connection kept open for it, as Prometheus does.
"""

from __future__ import annotations

import threading
import urllib.error
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import metrics as names
from hybridllm_common.speed import REFERENCE_LOAD, TierSpeed, mean_speed
from hybridllm_operator.llmservice.demand.common import (
    HTTP_TIMEOUT_S,
    OFFERED_COMPLETION,
    OFFERED_PROMPT,
    TIERS,
    TTFT_QUANTILE,
    DemandSource,
    Snapshot,
    TierDemand,
    histogram_quantile,
)

# --------------------------------------------------------------------------- binning


@dataclass
class Bins:
    """Token counts spread over fixed bins of wall-clock time, for the forecast's history."""

    bin_s: float
    max_bins: int
    first: int | None = None  # index (time // bin_s) of the oldest bin kept
    sums: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, t0: float, t1: float, prompt: float, completion: float) -> None:
        """Tokens counted over [t0, t1], spread evenly over that interval."""
        if t1 <= t0:
            return
        k0, k1 = int(t0 // self.bin_s), int(t1 // self.bin_s)
        if self.first is None:
            self.first = k0
        while self.first + len(self.sums) <= k1:
            self.sums.append((0.0, 0.0))
        for k in range(max(k0, self.first), k1 + 1):
            lo, hi = max(t0, k * self.bin_s), min(t1, (k + 1) * self.bin_s)
            share = (hi - lo) / (t1 - t0)
            p, c = self.sums[k - self.first]
            self.sums[k - self.first] = (p + prompt * share, c + completion * share)
        while len(self.sums) > self.max_bins + 1:
            self.sums.popleft()
            self.first += 1

    def complete(self, now_s: float) -> tuple[list[tuple[float, float]], float]:
        """Rates of the bins that ended before ``now_s``, and when the first began."""
        if self.first is None:
            return [], 0.0
        done = min(len(self.sums), int(now_s // self.bin_s) - self.first)
        rates = [(p / self.bin_s, c / self.bin_s) for p, c in list(self.sums)[: max(done, 0)]]
        return rates, self.first * self.bin_s


# --------------------------------------------------------------------------- scraping


@dataclass
class _Sample:
    t: float
    prompt: dict[str, float]
    completion: dict[str, float]
    in_flight: dict[str, float]
    ttft: dict[str, dict[float, float]]  # tier -> cumulative buckets
    held: dict[str, float] = field(default_factory=dict)
    cold: dict[str, float] = field(default_factory=dict)
    overloaded: dict[str, float] = field(default_factory=dict)  # cumulative 503 answers
    timed_out: dict[str, float] = field(default_factory=dict)  # cumulative first-byte timeouts
    # tier -> replica -> [prefill tokens/s, s/token at load 1, at REFERENCE_LOAD, answers]
    speeds: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)


def parse_gateway_metrics(text: str, t: float) -> _Sample:
    sample = _Sample(t, {}, {}, {}, {})
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            tier = s.labels.get("tier")
            if tier is None:
                continue
            if s.name == OFFERED_PROMPT:
                sample.prompt[tier] = s.value
            elif s.name == OFFERED_COMPLETION:
                sample.completion[tier] = s.value
            elif s.name == names.GATEWAY_OUTSTANDING_REQUESTS:
                sample.in_flight[tier] = s.value
            elif s.name == names.GATEWAY_HELD_REQUESTS:
                sample.held[tier] = s.value
            elif s.name == names.GATEWAY_COLD_REQUESTS_TOTAL:
                sample.cold[tier] = s.value
            elif s.name == names.GATEWAY_REQUESTS_TOTAL and s.labels.get("code") == "503":
                sample.overloaded[tier] = sample.overloaded.get(tier, 0.0) + s.value
            elif (
                s.name == names.GATEWAY_UPSTREAM_ERRORS_TOTAL
                and s.labels.get("kind") == names.UpstreamErrorKind.TIMEOUT
            ):
                sample.timed_out[tier] = sample.timed_out.get(tier, 0.0) + s.value
            elif s.name == names.TIME_TO_FIRST_TOKEN_SECONDS + "_bucket":
                sample.ttft.setdefault(tier, {})[float(s.labels["le"])] = s.value
            elif s.name in SPEED_COLUMNS or s.name == ANSWERS:
                row = sample.speeds.setdefault(tier, {}).setdefault(
                    str(s.labels.get("replica")), [None, None, None, 0.0]
                )
                load = s.labels.get("load")
                if s.name == ANSWERS:
                    row[3] = s.value
                elif s.name != names.GATEWAY_REPLICA_OUTPUT_SECONDS:
                    row[0] = s.value
                elif load in ("1", str(REFERENCE_LOAD)):
                    row[1 if load == "1" else 2] = s.value
    return sample


SPEED_COLUMNS = (
    names.GATEWAY_REPLICA_PREFILL_TOKENS_PER_SECOND,
    names.GATEWAY_REPLICA_OUTPUT_SECONDS,
)
ANSWERS = names.GATEWAY_REPLICA_ANSWERS_TOTAL


def tier_speeds(samples: Iterable[_Sample]) -> dict[str, TierSpeed]:
    """Each tier's speed over every replica every gateway has learned."""
    rows: dict[str, list[tuple[float | None, float | None, float | None, float]]] = {}
    for sample in samples:
        for tier, replicas in sample.speeds.items():
            for p, t1, tref, answers in replicas.values():
                rows.setdefault(tier, []).append((p, t1, tref, float(answers or 0.0)))
    return {tier: mean_speed(r) for tier, r in rows.items()}


def _increase(new: float, old: float | None) -> float:
    """A counter's increase; a counter that went down restarted from zero."""
    if old is None or new < old:
        return new
    return new - old


class GatewayScrape(DemandSource):
    """Demand read from the gateways' own ``/metrics``. ``urls`` gives the metrics URL of
    every Ready gateway replica at the time of each read."""

    def __init__(
        self,
        urls: Callable[[], Iterable[str]],
        bin_s: float = 60.0,
        max_bins: int = 2 * 24 * 60,
        fetch: Callable[[str], str] | None = None,
    ) -> None:
        self.urls = urls
        self.fetch = fetch or scrape
        self.last: dict[str, _Sample] = {}
        self.bins = {tier: Bins(bin_s, max_bins) for tier in TIERS}
        self.lock = threading.Lock()  # one read at a time (reads share `last` and `bins`)

    def read(self, now_s: float) -> Snapshot:
        with self.lock:
            return self._read(now_s)

    def _read(self, now_s: float) -> Snapshot:
        urls = sorted(set(self.urls()))
        problems: dict[str, str] = {}
        if not urls:
            problems = dict.fromkeys(TIERS, "no Ready gateway replica to read demand from")
        fresh: dict[str, _Sample] = {}
        failed: list[str] = []
        for url in urls:
            try:
                fresh[url] = parse_gateway_metrics(self.fetch(url), now_s)
            except (OSError, ValueError, urllib.error.URLError) as exc:
                failed.append(f"{url}: {exc}")
        prompt = dict.fromkeys(TIERS, 0.0)
        completion = dict.fromkeys(TIERS, 0.0)
        in_flight = dict.fromkeys(TIERS, 0.0)
        waiting = dict.fromkeys(TIERS, 0.0)
        overloaded = dict.fromkeys(TIERS, 0.0)
        timed_out = dict.fromkeys(TIERS, 0.0)
        buckets: dict[str, dict[float, float]] = {t: {} for t in TIERS}
        spans: dict[str, float] = {}
        new_replicas = []
        for url, s in fresh.items():
            old = self.last.get(url)
            for tier in TIERS:
                if tier not in s.prompt:
                    continue
                in_flight[tier] += s.in_flight.get(tier, 0.0)
                waiting[tier] += s.held.get(tier, 0.0)
                if old is None or tier not in old.prompt:
                    continue
                waiting[tier] += _increase(s.cold.get(tier, 0.0), old.cold.get(tier))
                overloaded[tier] += _increase(s.overloaded.get(tier, 0.0), old.overloaded.get(tier))
                timed_out[tier] += _increase(s.timed_out.get(tier, 0.0), old.timed_out.get(tier))
                dp = _increase(s.prompt[tier], old.prompt.get(tier))
                dc = _increase(s.completion.get(tier, 0.0), old.completion.get(tier))
                self.bins[tier].add(old.t, s.t, dp, dc)
                span = s.t - old.t
                spans[tier] = max(spans.get(tier, 0.0), span)
                prompt[tier] += dp / span if span > 0 else 0.0
                completion[tier] += dc / span if span > 0 else 0.0
                for le, v in s.ttft.get(tier, {}).items():
                    buckets[tier][le] = buckets[tier].get(le, 0.0) + _increase(
                        v, old.ttft.get(tier, {}).get(le)
                    )
            if old is None:
                new_replicas.append(url)
        self.last = {**{u: s for u, s in self.last.items() if u in urls}, **fresh}
        tiers: dict[str, TierDemand] = {}
        speeds = tier_speeds(fresh.values())
        for tier in TIERS:
            if tier in problems:
                continue
            if failed:
                problems[tier] = "gateway metrics could not be read: " + "; ".join(failed)
            elif new_replicas:
                problems[tier] = (
                    "first sample of gateway(s) " + ", ".join(new_replicas) + ": a rate needs two"
                )
            elif tier not in spans:
                problems[tier] = "the gateways export no demand series for this tier"
            else:
                tiers[tier] = TierDemand(
                    prompt[tier],
                    completion[tier],
                    in_flight[tier],
                    histogram_quantile(TTFT_QUANTILE, buckets[tier]),
                    waiting[tier],
                    overloaded[tier],
                    speeds.get(tier),
                    timed_out[tier],
                )
        bins, start = self._aligned_bins(now_s)
        return Snapshot(tiers, bins, start, problems)

    def _aligned_bins(self, now_s: float) -> tuple[dict[str, list[tuple[float, float]]], float]:
        """Every tier's complete bins from one start (the snapshot has one): the earliest
        tier's; a tier first seen later is zero before (no series, no demand). A tier
        never seen has none (an edge-only service has no cloud series)."""
        done = {tier: self.bins[tier].complete(now_s) for tier in TIERS}
        starts = [start for rates, start in done.values() if rates]
        if not starts:
            return {tier: [] for tier in TIERS}, 0.0
        first = min(starts)
        bins = {}
        for tier, (rates, start) in done.items():
            pad = round((start - first) / self.bins[tier].bin_s) if rates else 0
            bins[tier] = [(0.0, 0.0)] * pad + rates
        return bins, first


# Scrapes keep one connection open per gateway replica, as Prometheus does: a thousand
# gateways read every interval would otherwise cost a thousand TCP connects (and their
# closes) each time. The gateway keeps idle connections for an hour; one a replica closed
# meanwhile is noticed before reuse, or the request is sent once more on a new one.
SCRAPE_POOLS = 4096  # replicas whose connection is kept (the least recently read go first)
_scrapes = urllib3.PoolManager(
    num_pools=SCRAPE_POOLS,
    maxsize=1,
    timeout=urllib3.Timeout(HTTP_TIMEOUT_S),
    retries=urllib3.Retry(total=1, connect=0, read=1, redirect=0, status=0),
)


def scrape(url: str) -> str:
    """A gateway's ``/metrics`` over its kept connection; OSError says why it failed."""
    try:
        response = _scrapes.request("GET", url, preload_content=True)
    except urllib3.exceptions.HTTPError as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from exc
    if response.status != 200:
        raise OSError(f"HTTP {response.status} {response.reason or ''}".rstrip())
    return bytes(response.data).decode()
