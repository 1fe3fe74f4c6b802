"""Each tier's demand as the autoscaler reads it: from Prometheus, or from the gateways.

The gateway counts the demand offered to every tier, on each request's arrival
(``hybridllm_gateway_offered_prompt_tokens_total``,
``hybridllm_gateway_offered_completion_tokens_total``, by ``tier``; completion tokens
estimated from the tier's recent answers), the requests in flight to each tier and the
time to first token. Those are the demand: pods that are not Ready get no traffic from
the gateway, so nothing a starting replica reports (its model load, its warm-up) is ever
counted as load. Offered, not answered: a pool short of replicas answers late, or at its
capacity, and a history of answers would teach the forecast yesterday's lag.

Two sources give the same `Snapshot`:

- `PrometheusDemand` asks a Prometheus server over its HTTP API (the operator's
  ``prometheusUrl`` setting). The gateway's series must carry the labels ``namespace``
  and ``llmservice`` (the LLMService's name; the chart's scrape config relabels them from
  the pod's namespace and its ``app.kubernetes.io/instance`` label). The history the
  forecast needs comes from a range query, so a restarted operator has it at once.
- `GatewayScrape` reads the gateways' ``/metrics`` itself (local mode, or a cluster
  without Prometheus): rates from the counters' increase between two scrapes, summed over
  the gateway replicas, and the history in bins it accumulates in memory.

A value that cannot be trusted is left out, with the reason in ``Snapshot.problems``:
no series yet, a NaN, a gateway that did not answer (a sum missing one replica would look
like a drop in load), a counter seen for the first time. The autoscaler holds on those.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import metrics as names

log = logging.getLogger(__name__)

TIERS = ("edge", "cloud")
TTFT_QUANTILE = 0.95
HTTP_TIMEOUT_S = 2.0
OFFERED_PROMPT = names.GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL
OFFERED_COMPLETION = names.GATEWAY_OFFERED_COMPLETION_TOKENS_TOTAL
MAX_RANGE_POINTS = 10_000  # Prometheus refuses range queries of more than 11,000 points


@dataclass(frozen=True)
class TierDemand:
    prompt_tok_s: float
    completion_tok_s: float
    in_flight: float = 0.0
    ttft_p95_s: float | None = None  # None: no request finished in the window
    # requests held for want of a replica now, plus those that found none in the window
    waiting: float = 0.0
    # requests the gateways answered 503 for this tier in the window (it was overloaded)
    overloaded: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """Demand per tier now, the history in bins, and what could not be read."""

    tiers: dict[str, TierDemand]
    bins: dict[str, list[tuple[float, float]]]  # tier -> complete bins (prompt, completion tok/s)
    bins_start_s: float  # when the first bin of every tier's list began
    problems: dict[str, str] = field(default_factory=dict)  # tier -> why it is missing


class DemandSource:
    def read(self, now_s: float) -> Snapshot:
        raise NotImplementedError


# --------------------------------------------------------------------------- histogram


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count}), interpolated
    linearly inside the bucket as Prometheus's ``histogram_quantile`` does."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # in the +Inf bucket: the largest finite bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


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
            elif s.name == names.TIME_TO_FIRST_TOKEN_SECONDS + "_bucket":
                sample.ttft.setdefault(tier, {})[float(s.labels["le"])] = s.value
    return sample


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


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return str(response.read().decode())


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


# --------------------------------------------------------------------------- Prometheus


class PrometheusError(Exception):
    pass


def prometheus_get(url: str, path: str, params: Mapping[str, str]) -> list[dict[str, Any]]:
    """The result of one Prometheus HTTP API query; PrometheusError says why there is none."""
    query = urllib.parse.urlencode(params)
    try:
        body = json.loads(_http_get(f"{url}{path}?{query}"))
    except urllib.error.HTTPError as exc:  # a 4xx/5xx carries Prometheus's reason
        try:
            reason = json.loads(exc.read()).get("error") or exc.reason
        except (OSError, ValueError):
            reason = exc.reason
        raise PrometheusError(
            f"Prometheus at {url} refused {params.get('query')!r}: {exc.code} {reason}"
        ) from exc
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"Prometheus at {url} did not answer: {exc}") from exc
    if body.get("status") != "success":
        raise PrometheusError(
            f"Prometheus refused the query: {body.get('errorType')}: {body.get('error')}"
        )
    result = body["data"]["result"]
    assert isinstance(result, list)
    return result


EVAL_QUANTUM_S = 5.0  # instant queries are evaluated at a multiple of this (shared answers)
BATCH_SELECTOR = 'llmservice!=""'  # every LLMService's gateway series
BATCH_BY = "namespace, llmservice, "


class PrometheusBatch:
    """Every LLMService's demand from one query per expression, shared by their readers.

    A `PrometheusDemand` of one LLMService asks for its own rows; the batch asks Prometheus
    once for every LLMService's (``sum by (namespace, llmservice, tier)``), keeps the
    answer indexed by service and hands each reader its part. An answer serves every
    reader that asks for the same expression at the same evaluation time (the autoscaler
    jobs of one interval all fire at the interval's boundary); a failed query serves its
    error the same way, so a Prometheus that is down is asked once, not once per service.
    A thousand LLMServices cost five queries per interval, not five thousand.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.lock = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}  # one per expression: readers wait for it
        self.answers: dict[str, tuple[tuple[str, ...], Any]] = {}
        self.queries = 0  # HTTP queries made (tests and metrics read it)

    def rows(
        self, name: str, path: str, params: Mapping[str, str], namespace: str, service: str
    ) -> list[dict[str, Any]]:
        """The rows of ``namespace/service`` in the answer to ``params``."""
        key = tuple(f"{k}={v}" for k, v in sorted(params.items()))
        with self.lock:
            lock = self.locks.setdefault(name, threading.Lock())
        with lock:
            cached = self.answers.get(name)
            if cached is None or cached[0] != key:
                try:
                    answer: Any = _index(prometheus_get(self.url, path, params))
                except PrometheusError as exc:
                    answer = exc
                self.queries += 1
                self.answers[name] = cached = (key, answer)
        if isinstance(cached[1], PrometheusError):
            raise cached[1]
        return list(cached[1].get((namespace, service), ()))


def _index(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        metric = row.get("metric") or {}
        out.setdefault((metric.get("namespace", ""), metric.get("llmservice", "")), []).append(row)
    return out


class PrometheusDemand(DemandSource):
    """Demand of one LLMService from a Prometheus server's HTTP API.

    With a `PrometheusBatch` (the operator gives every LLMService the same one) the
    instant queries and the newest bin of history come from the batch's shared answers;
    the whole history is asked for this service alone only when it has none (its first
    read, after a restart) or missed a bin. Without one, every query is its own.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        llmservice: str,
        *,
        bin_s: float = 60.0,
        lookback_s: float = 2 * 86_400.0,
        rate_window_s: float = 60.0,
        batch: PrometheusBatch | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.namespace, self.llmservice = namespace, llmservice
        self.selector = f'namespace="{namespace}",llmservice="{llmservice}"'
        self.bin_s, self.lookback_s, self.rate_window_s = bin_s, lookback_s, rate_window_s
        self.batch = batch
        self._bins_until: float | None = None
        self._bins: tuple[dict[str, list[tuple[float, float]]], float] = ({}, 0.0)

    def _get(self, path: str, params: Mapping[str, str]) -> list[dict[str, Any]]:
        return prometheus_get(self.url, path, params)

    def _exprs(self, sel: str, by: str) -> dict[str, str]:
        """The instant queries, over the series ``sel`` selects, summed by ``by`` tier."""
        w = f"{int(self.rate_window_s)}s"
        return {
            "prompt": f"sum by ({by}tier) (rate({OFFERED_PROMPT}{{{sel}}}[{w}]))",
            "completion": f"sum by ({by}tier) (rate({OFFERED_COMPLETION}{{{sel}}}[{w}]))",
            "in_flight": f"sum by ({by}tier) ({names.GATEWAY_OUTSTANDING_REQUESTS}{{{sel}}})",
            "waiting": (
                f"sum by ({by}tier) ({names.GATEWAY_HELD_REQUESTS}{{{sel}}}) + sum by ({by}tier) "
                f"(increase({names.GATEWAY_COLD_REQUESTS_TOTAL}{{{sel}}}[{w}]))"
            ),
            "overloaded": (
                f"sum by ({by}tier) (increase({names.GATEWAY_REQUESTS_TOTAL}"
                f'{{{sel},code="503"}}[{w}]))'
            ),
            "ttft": (
                f"histogram_quantile({TTFT_QUANTILE}, sum by ({by}tier, le) "
                f"(rate({names.TIME_TO_FIRST_TOKEN_SECONDS}_bucket{{{sel}}}[{w}])))"
            ),
        }

    def _by_tier(self, name: str, at: float) -> dict[str, float]:
        """One instant query's value per tier: from the batch's answer over every
        LLMService, or asked for this one alone."""
        params = {"time": f"{at:.3f}"}
        rows: list[dict[str, Any]]
        if self.batch is not None:
            query = self._exprs(BATCH_SELECTOR, BATCH_BY)[name]
            rows = self.batch.rows(
                name, "/api/v1/query", {**params, "query": query}, self.namespace, self.llmservice
            )
        else:
            query = self._exprs(self.selector, "")[name]
            rows = self._get("/api/v1/query", {**params, "query": query})
        return {str(r["metric"].get("tier", "")): float(r["value"][1]) for r in rows}

    def read(self, now_s: float) -> Snapshot:
        w = f"{int(self.rate_window_s)}s"
        sel = self.selector
        # the evaluation time every reader of one boundary shares (see PrometheusBatch)
        at = math.floor(now_s / EVAL_QUANTUM_S) * EVAL_QUANTUM_S if self.batch else now_s
        problems: dict[str, str] = {}
        try:
            prompt, completion, in_flight, waiting, ttft, overloaded = (
                self._by_tier(name, at)
                for name in ("prompt", "completion", "in_flight", "waiting", "ttft", "overloaded")
            )
            bins, start = self._history(now_s)
        except PrometheusError as exc:
            return Snapshot({}, {}, 0.0, dict.fromkeys(TIERS, str(exc)))
        tiers = {}
        for tier in TIERS:
            p, c = prompt.get(tier), completion.get(tier)
            if p is None or c is None:
                problems[tier] = (
                    f"Prometheus has no series of {OFFERED_PROMPT}"
                    f'{{{sel},tier="{tier}"}} over the last {w} (is it scraping the gateway '
                    "with the labels namespace and llmservice?)"
                )
            elif not (math.isfinite(p) and math.isfinite(c)):
                problems[tier] = f"Prometheus answered NaN for the demand of tier {tier}"
            else:
                q = ttft.get(tier)
                held = waiting.get(tier, 0.0)
                turned = overloaded.get(tier, 0.0)
                tiers[tier] = TierDemand(
                    p,
                    c,
                    in_flight.get(tier, 0.0),
                    q if q is not None and math.isfinite(q) else None,
                    held if math.isfinite(held) else 0.0,
                    turned if math.isfinite(turned) else 0.0,
                )
        return Snapshot(tiers, bins, start, problems)

    def _history(self, now_s: float) -> tuple[dict[str, list[tuple[float, float]]], float]:
        """Complete bins over the lookback: one range query per counter for the whole
        history, then (with a batch) the one new bin of each bin's end from the batch."""
        end = math.floor(now_s / self.bin_s) * self.bin_s  # the end of the last complete bin
        if self._bins_until == end:
            return self._bins
        # Prometheus answers at most 11,000 points per series
        count = min(math.floor(self.lookback_s / self.bin_s), MAX_RANGE_POINTS)
        if self.batch is not None and self._bins_until == end - self.bin_s:
            self._bins = self._append(self._newest_bin(end), count)
            self._bins_until = end
            return self._bins
        start = end - count * self.bin_s
        b = f"{int(self.bin_s)}s"
        series: dict[str, dict[str, dict[float, float]]] = {}
        for key, metric in (
            ("prompt", OFFERED_PROMPT),
            ("completion", OFFERED_COMPLETION),
        ):
            rows = self._get(
                "/api/v1/query_range",
                {
                    "query": f"sum by (tier) (increase({metric}{{{self.selector}}}[{b}]))",
                    "start": f"{start + self.bin_s:.3f}",
                    "end": f"{end:.3f}",
                    "step": b,
                },
            )
            for row in rows:
                tier = str(row["metric"].get("tier", ""))
                values = {float(t): float(v) for t, v in row["values"]}
                series.setdefault(tier, {})[key] = values
        bins: dict[str, list[tuple[float, float]]] = {}
        first = None
        for kinds in series.values():
            times = sorted(kinds.get("prompt", {}))
            if not times:
                continue
            first = times[0] if first is None else min(first, times[0])
        for tier, kinds in series.items():
            p, c = kinds.get("prompt", {}), kinds.get("completion", {})
            if first is None:
                break
            out = []
            t = first
            while t <= end + 1e-6:
                pv, cv = p.get(t, 0.0), c.get(t, 0.0)
                out.append(
                    (pv / self.bin_s if math.isfinite(pv) else 0.0,
                     cv / self.bin_s if math.isfinite(cv) else 0.0)
                )  # fmt: skip
                t += self.bin_s
            bins[tier] = out
        # a value at t is the increase over (t - bin, t]: the first bin began one bin earlier
        self._bins_until = end
        self._bins = (bins, (first - self.bin_s) if first is not None else 0.0)
        return self._bins

    def _newest_bin(self, end: float) -> dict[str, tuple[float, float]]:
        """Each tier's token rates over the bin that ended at ``end``, from the batch: the
        value a range query gives at ``end``."""
        assert self.batch is not None
        b = f"{int(self.bin_s)}s"
        out: dict[str, list[float]] = {}
        for i, metric in enumerate((OFFERED_PROMPT, OFFERED_COMPLETION)):
            rows = self.batch.rows(
                f"bin:{metric}:{b}",
                "/api/v1/query",
                {
                    "query": f"sum by ({BATCH_BY}tier) (increase({metric}{{{BATCH_SELECTOR}}}[{b}]))",
                    "time": f"{end:.3f}",
                },
                self.namespace,
                self.llmservice,
            )
            for row in rows:
                value = float(row["value"][1])
                tier = out.setdefault(str(row["metric"].get("tier", "")), [0.0, 0.0])
                tier[i] = value / self.bin_s if math.isfinite(value) else 0.0
        return {tier: (p, c) for tier, (p, c) in out.items()}

    def _append(
        self, newest: dict[str, tuple[float, float]], count: int
    ) -> tuple[dict[str, list[tuple[float, float]]], float]:
        """The history with one more bin at its end, the oldest dropped past ``count``: the
        bins a whole-history query would give now."""
        old, start = self._bins
        length = len(next(iter(old.values()))) if old else 0
        if not old and not newest:
            return {}, 0.0
        if not old:
            start = self._bins_until if self._bins_until is not None else 0.0
        bins = {
            tier: [*old.get(tier, [(0.0, 0.0)] * length), newest.get(tier, (0.0, 0.0))]
            for tier in {*old, *newest}
        }
        drop = max(0, length + 1 - count)
        if drop:
            bins = {tier: values[drop:] for tier, values in bins.items()}
            start += drop * self.bin_s
        return bins, start
