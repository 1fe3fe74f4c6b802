"""The rollout analysis: a canary revision against the stable one, over the same window.

Each gateway exports, per tier and model revision, its upstream attempts by result, a
time-to-first-token histogram and a time-per-output-token histogram
(``hybridllm_gateway_revision_*``). A window is the increase of those series between
the moment a step's weight took effect and now, summed over the gateways: read from
Prometheus (``increase(...[window])``) or from the gateways' ``/metrics`` directly
(snapshots at the window's start and now), as the autoscaler reads its demand.

:func:`judge` compares the canary with the stable revision on three metrics:

- **errorRate**: failed attempts over attempts (a failure the gateway retried elsewhere
  still counts against the revision that failed). Fails when the canary's rate is above
  ``maxErrorRate`` and a one-sided Fisher exact test says it is higher than the stable
  revision's;
- **ttftP95** and **tbtP95**: fail when the canary's p95 is more than
  ``maxLatencyIncrease`` above the stable's, or above the absolute bound while the
  stable's is within it, *and* a one-sided Mann-Whitney U test on the two histograms
  says the canary is slower. Each of the three tests runs at a third of
  ``significance`` (Bonferroni), so one look at an A/A window fails with at most that
  chance. The test runs on the buckets themselves: every observation
  in a bucket is a tie, and the variance takes the ties into account, so no raw sample
  is needed and the test is exact about what the histograms know.

Requiring both a practical difference and a significant one keeps an A/A rollout (the
same revision on both sides) from aborting on noise: ``bench/rollout/analysis.py``
measures that false-abort rate, and the power against slower canaries. Below
``minRequests`` on either side, a window is inconclusive; the time-between-tokens test
needs streamed answers and is left out (``n/a``) without them. At weight 100 nothing is
left to compare with: only the absolute bounds apply.
"""

from __future__ import annotations

import math
import threading
import urllib.error
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import crd
from hybridllm_common import metrics as names
from hybridllm_operator.llmservice.demand import (
    PrometheusError,
    histogram_quantile,
    prometheus_get,
    scrape,
)

PASS, FAIL, INCONCLUSIVE, NA = (
    crd.VERDICT_PASS, crd.VERDICT_FAIL, crd.VERDICT_INCONCLUSIVE, crd.VERDICT_NA
)  # fmt: skip
MIN_LATENCY_SAMPLES = 20  # fewer time-per-token samples: that metric is not judged
METRICS = 3  # error rate, TTFT p95, time-between-tokens p95


@dataclass
class RevisionWindow:
    """What one revision of one tier did over a window (increases, summed over gateways)."""

    ok: float = 0.0
    errors: float = 0.0
    ttft: dict[float, float] = field(default_factory=dict)  # cumulative buckets, le -> count
    tpot: dict[float, float] = field(default_factory=dict)

    @property
    def attempts(self) -> float:
        return self.ok + self.errors

    def add(self, other: RevisionWindow) -> None:
        self.ok += other.ok
        self.errors += other.errors
        for mine, theirs in ((self.ttft, other.ttft), (self.tpot, other.tpot)):
            for le, v in theirs.items():
                mine[le] = mine.get(le, 0.0) + v


@dataclass
class Window:
    """A window's per-revision results and the gateways' view of the routing table."""

    revisions: dict[tuple[str, str], RevisionWindow] = field(default_factory=dict)  # (tier, rev)
    # (tier, revision) -> its healthy backends at the gateway that has the fewest
    healthy: dict[tuple[str, str], float] = field(default_factory=dict)
    gateways: int = 0
    generation: float = 0.0  # the oldest routing generation any gateway serves
    problem: str | None = None  # why the window could not be read
    # (tier, revision, golden prompt index) -> 1 passed, 0 failed, on every gateway (a
    # prompt some gateway has not asked yet is absent)
    golden: dict[tuple[str, str, int], float] = field(default_factory=dict)

    def revision(self, tier: str, revision: str) -> RevisionWindow:
        return self.revisions.get((tier, revision), RevisionWindow())

    def merged(self, tiers: Iterable[str], revision: str) -> RevisionWindow:
        """One revision's window over several tiers (edge and cloud move together)."""
        out = RevisionWindow()
        for tier in tiers:
            out.add(self.revision(tier, revision))
        return out


# --------------------------------------------------------------------------- statistics


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _counts(cumulative: Mapping[float, float], bounds: list[float]) -> list[float]:
    out, below = [], 0.0
    for le in bounds:
        c = cumulative.get(le, below)
        out.append(max(0.0, c - below))
        below = max(below, c)
    return out


def mann_whitney_greater(a: Mapping[float, float], b: Mapping[float, float]) -> float | None:
    """One-sided p-value that ``a`` is stochastically greater than ``b``, from two
    cumulative histograms with the same buckets (ties within a bucket, tie-corrected
    normal approximation with continuity correction). None without samples on a side."""
    bounds = sorted(set(a) | set(b))
    ca, cb = _counts(a, bounds), _counts(b, bounds)
    n1, n2 = sum(ca), sum(cb)
    if n1 <= 0 or n2 <= 0:
        return None
    u, below = 0.0, 0.0
    for x, y in zip(ca, cb, strict=True):
        u += x * (below + 0.5 * y)
        below += y
    n = n1 + n2
    ties = sum((x + y) ** 3 - (x + y) for x, y in zip(ca, cb, strict=True))
    variance = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:
        return 0.5
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(variance)
    return 1.0 - _phi(z)


def proportion_greater(e1: float, n1: float, e2: float, n2: float) -> float | None:
    """One-sided p-value that the rate e1/n1 is greater than e2/n2: Fisher's exact test
    (the hypergeometric tail), which stays honest with the handful of errors a canary at
    a small weight produces, where a normal approximation aborts good canaries."""
    a, n1i, b, n2i = (max(0, round(x)) for x in (e1, n1, e2, n2))
    if n1i <= 0 or n2i <= 0:
        return None
    a, b = min(a, n1i), min(b, n2i)
    total, errors = n1i + n2i, a + b
    if errors == 0:
        return 1.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    base = log_comb(total, errors)
    tail = 0.0
    for k in range(a, min(n1i, errors) + 1):  # P(X >= a), X ~ Hypergeometric
        tail += math.exp(log_comb(n1i, k) + log_comb(n2i, errors - k) - base)
    return min(1.0, tail)


@dataclass(frozen=True)
class Verdict:
    outcome: str  # pass, fail or inconclusive
    metrics: list[crd.MetricVerdict]
    message: str


def _latency(
    metric: str,
    canary: Mapping[float, float],
    stable: Mapping[float, float] | None,
    bound: float,
    increase: float,
    alpha: float,
    required: float,
) -> crd.MetricVerdict:
    c95 = histogram_quantile(0.95, canary) if canary else None
    s95 = histogram_quantile(0.95, stable) if stable else None
    n_c = max(canary.values(), default=0.0)
    if stable is None:  # weight 100: the absolute bound alone
        failed = c95 is not None and n_c >= required and c95 > bound
        result = FAIL if failed else (PASS if n_c >= required else INCONCLUSIVE)
        return crd.MetricVerdict(metric=metric, canary=c95, stable=None, result=result)
    n_s = max(stable.values(), default=0.0)
    if min(n_c, n_s) < required:
        return crd.MetricVerdict(metric=metric, canary=c95, stable=s95, result=INCONCLUSIVE)
    p = mann_whitney_greater(canary, stable)
    worse = (
        c95 is not None and s95 is not None and (c95 > s95 * (1 + increase) or (c95 > bound >= s95))
    )
    result = FAIL if worse and p is not None and p < alpha else PASS
    return crd.MetricVerdict(metric=metric, canary=c95, stable=s95, p_value=p, result=result)


def judge(
    canary: RevisionWindow,
    stable: RevisionWindow | None,
    spec: crd.RolloutAnalysis,
    alpha: float | None = None,
) -> Verdict:
    """The canary's window against the stable's (None at weight 100: bounds only).
    ``alpha`` overrides the spec's significance (an early look at a step uses a stricter one)."""
    # three metrics are tested: each at a third of it (Bonferroni), so the chance that a
    # look at an A/A window fails on any of them stays within the significance
    alpha = (spec.significance if alpha is None else alpha) / METRICS
    need = float(spec.min_requests)
    verdicts = []
    rate = canary.errors / canary.attempts if canary.attempts else None
    if stable is None:
        failed = rate is not None and canary.attempts >= need and rate > spec.max_error_rate
        verdicts.append(
            crd.MetricVerdict(
                metric="errorRate", canary=rate,
                result=FAIL if failed else (PASS if canary.attempts >= need else INCONCLUSIVE),
            )
        )  # fmt: skip
    else:
        s_rate = stable.errors / stable.attempts if stable.attempts else None
        if min(canary.attempts, stable.attempts) < need:
            result, p = INCONCLUSIVE, None
        else:
            p = proportion_greater(canary.errors, canary.attempts, stable.errors, stable.attempts)
            failed = rate is not None and rate > spec.max_error_rate and p is not None and p < alpha
            result = FAIL if failed else PASS
        verdicts.append(
            crd.MetricVerdict(
                metric="errorRate", canary=rate, stable=s_rate, p_value=p, result=result
            )
        )
    verdicts.append(
        _latency("ttftP95", canary.ttft, stable.ttft if stable else None,
                 spec.max_ttft_p95_seconds, spec.max_latency_increase, alpha, need)
    )  # fmt: skip
    tbt = _latency("tbtP95", canary.tpot, stable.tpot if stable else None,
                   spec.max_tbt_p95_seconds, spec.max_latency_increase, alpha,
                   float(MIN_LATENCY_SAMPLES))  # fmt: skip
    if tbt.result == INCONCLUSIVE:
        tbt = tbt.model_copy(update={"result": NA})  # no streamed answers: not judged
    verdicts.append(tbt)
    failing = [v for v in verdicts if v.result == FAIL]
    if failing:
        return Verdict(FAIL, verdicts, "; ".join(describe(v) for v in failing))
    if any(v.result == INCONCLUSIVE for v in verdicts):
        n_s = f", stable {stable.attempts:.0f}" if stable is not None else ""
        return Verdict(
            INCONCLUSIVE,
            verdicts,
            f"too few requests to judge ({spec.min_requests} needed on each side): "
            f"canary {canary.attempts:.0f}{n_s}",
        )
    return Verdict(PASS, verdicts, "; ".join(describe(v) for v in verdicts if v.result == PASS))


def combine(verdicts: Mapping[str, Verdict]) -> Verdict:
    """One verdict from each tier's: a failing tier fails it, an undecided one holds it."""
    metrics = [m.model_copy(update={"tier": t}) for t, v in verdicts.items() for m in v.metrics]
    several = len(verdicts) > 1
    for outcome in (FAIL, INCONCLUSIVE):
        hit = [(t, v) for t, v in verdicts.items() if v.outcome == outcome]
        if hit:
            text = "; ".join(f"{t}: {v.message}" if several else v.message for t, v in hit)
            return Verdict(outcome, metrics, text)
    text = "; ".join(f"{t}: {v.message}" if several else v.message for t, v in verdicts.items())
    return Verdict(PASS, metrics, text)


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == "errorRate":
        return f"{100 * value:.1f}%"
    return f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def describe(v: crd.MetricVerdict) -> str:
    """One metric's verdict as a user reads it: 'ttftP95 canary 812 ms vs stable 240 ms'."""
    text = (f"{v.tier} " if v.tier else "") + f"{v.metric} canary {_fmt(v.metric, v.canary)}"
    if v.stable is not None or v.p_value is not None:
        text += f" vs stable {_fmt(v.metric, v.stable)}"
    if v.p_value is not None:
        text += f" (p={v.p_value:.2g})"
    return text


# --------------------------------------------------------------------------- reading windows


@dataclass
class _Scrape:
    counters: dict[tuple[str, str, str], float] = field(default_factory=dict)  # tier, rev, result
    ttft: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)
    tpot: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)
    healthy: dict[tuple[str, str], float] = field(default_factory=dict)
    golden: dict[tuple[str, str, int], float] = field(default_factory=dict)
    generation: float = 0.0


def parse_revision_metrics(text: str) -> _Scrape:
    out = _Scrape()
    hist = {
        names.GATEWAY_REVISION_TTFT_SECONDS + "_bucket": out.ttft,
        names.GATEWAY_REVISION_TPOT_SECONDS + "_bucket": out.tpot,
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == names.GATEWAY_ROUTING_GENERATION:
                out.generation = s.value
            tier, revision = s.labels.get("tier"), s.labels.get("revision")
            if tier is None or revision is None:
                continue
            key = (tier, revision)
            if s.name == names.GATEWAY_REVISION_ATTEMPTS_TOTAL:
                out.counters[(tier, revision, s.labels.get("result", ""))] = s.value
            elif s.name in hist:
                hist[s.name].setdefault(key, {})[float(s.labels["le"])] = s.value
            elif s.name == names.GATEWAY_REVISION_HEALTHY_BACKENDS:
                out.healthy[key] = s.value
            elif s.name == names.GATEWAY_REVISION_GOLDEN_PASSED:
                out.golden[(tier, revision, int(s.labels.get("prompt", "0")))] = s.value
    return out


def _delta(new: float, old: float | None) -> float:
    return new if old is None or new < old else new - old


def _golden_everywhere(scrapes: Iterable[_Scrape]) -> dict[tuple[str, str, int], float]:
    """Each golden verdict every gateway has, at its worst."""
    scrapes = list(scrapes)
    keys = set.intersection(*(set(s.golden) for s in scrapes)) if scrapes else set()
    return {k: min(s.golden[k] for s in scrapes) for k in keys}


def _fewest_healthy(scrapes: Iterable[_Scrape]) -> dict[tuple[str, str], float]:
    scrapes = list(scrapes)
    keys = {k for s in scrapes for k in s.healthy}
    return {k: min(s.healthy.get(k, 0.0) for s in scrapes) for k in keys}


class WindowSource:
    """Reads a window of per-revision results, from ``start`` (Unix time) to now."""

    def read(self, start: float | None, now: float) -> Window:
        """Results since ``start`` (None: only the gateways' view of the routing table)."""
        raise NotImplementedError


class ScrapeWindows(WindowSource):
    """From the gateways' ``/metrics``: the snapshot taken at (or first after) a window's
    start is the baseline; a gateway that restarted since counts from zero."""

    def __init__(
        self, urls: Callable[[], Iterable[str]], fetch: Callable[[str], str] | None = None
    ) -> None:
        self.urls, self.fetch = urls, fetch or scrape
        self.baseline: tuple[float, dict[str, _Scrape]] | None = None
        self.lock = threading.Lock()

    def read(self, start: float | None, now: float) -> Window:
        with self.lock:
            urls = sorted(set(self.urls()))
            if not urls:
                return Window(problem="no Ready gateway replica to read from")
            fresh, failed = {}, []
            for url in urls:
                try:
                    fresh[url] = parse_revision_metrics(self.fetch(url))
                except (OSError, ValueError, urllib.error.URLError) as exc:
                    failed.append(f"{url}: {exc}")
            if failed:
                return Window(problem="gateway metrics could not be read: " + "; ".join(failed))
            window = Window(
                healthy=_fewest_healthy(fresh.values()),
                golden=_golden_everywhere(fresh.values()),
                gateways=len(fresh),
                generation=min(s.generation for s in fresh.values()),
            )
            if start is None:
                return window
            if self.baseline is None or self.baseline[0] != start:
                self.baseline = (start, fresh)  # the window begins now
                return window
            base = self.baseline[1]
            for url, s in fresh.items():
                old = base.get(url, _Scrape())
                for (tier, rev, result), v in s.counters.items():
                    w = window.revisions.setdefault((tier, rev), RevisionWindow())
                    inc = _delta(v, old.counters.get((tier, rev, result)))
                    if result == "error":
                        w.errors += inc
                    else:
                        w.ok += inc
                for attr in ("ttft", "tpot"):
                    for key, buckets in getattr(s, attr).items():
                        w = window.revisions.setdefault(key, RevisionWindow())
                        mine, was = getattr(w, attr), getattr(old, attr).get(key, {})
                        for le, v in buckets.items():
                            mine[le] = mine.get(le, 0.0) + _delta(v, was.get(le))
            return window


@dataclass(frozen=True)
class DeviceKpis:
    """What one revision's online devices of a fleet report in their heartbeats, as the
    fleet server aggregates them (its /metrics)."""

    devices: float
    error_rate: float | None = None  # weighted by requests
    ttft_p95: float | None = None  # the median over the devices of their TTFT p95


class DeviceKpiSource:
    """Reads a fleet's per-revision device KPIs."""

    def read(self, fleet: str, now: float) -> dict[str, DeviceKpis]:
        raise NotImplementedError


class PrometheusDeviceKpis(DeviceKpiSource):
    """From Prometheus, which scrapes the fleet server (the chart's monitors do)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def read(self, fleet: str, now: float) -> dict[str, DeviceKpis]:
        sel = f'fleet="{fleet}"'
        values: dict[str, dict[str, float]] = {}
        for attr, metric in (
            ("devices", names.FLEET_REVISION_DEVICES),
            ("error_rate", names.FLEET_REVISION_ERROR_RATE),
            ("ttft_p95", names.FLEET_REVISION_TTFT_P95_SECONDS),
        ):
            rows = prometheus_get(
                self.url, "/api/v1/query",
                {"query": f"max by (revision) ({metric}{{{sel}}})", "time": f"{now:.3f}"},
            )  # fmt: skip
            for row in rows:
                revision = str(row["metric"].get("revision", ""))
                values.setdefault(revision, {})[attr] = float(row["value"][1])
        return {
            rev: DeviceKpis(v.get("devices", 0.0), v.get("error_rate"), v.get("ttft_p95"))
            for rev, v in values.items()
            if v.get("devices", 0.0) > 0
        }


def judge_devices(
    canary: DeviceKpis | None, stable: DeviceKpis | None, spec: crd.RolloutAnalysis
) -> Verdict | None:
    """The canary revision's devices against the stable revision's (or, with none left on
    it, against the bounds alone), on what they report: aggregates, so bounds and a
    relative margin decide, without a test. None when no device reports the canary."""
    if canary is None or canary.devices <= 0:
        return None
    out, failed = [], []
    if canary.error_rate is not None:
        worse = stable is None or stable.error_rate is None or canary.error_rate > stable.error_rate
        fail = canary.error_rate > spec.max_error_rate and worse
        out.append(crd.MetricVerdict(
            metric="errorRate", tier="devices", canary=canary.error_rate,
            stable=stable.error_rate if stable else None, result=FAIL if fail else PASS,
        ))  # fmt: skip
        failed += ["errorRate"] if fail else []
    if canary.ttft_p95 is not None:
        base = stable.ttft_p95 if stable is not None else None
        over = canary.ttft_p95 > spec.max_ttft_p95_seconds and (
            base is None or base <= spec.max_ttft_p95_seconds
        )
        slower = base is not None and canary.ttft_p95 > base * (1 + spec.max_latency_increase)
        fail = over or slower
        out.append(crd.MetricVerdict(
            metric="ttftP95", tier="devices", canary=canary.ttft_p95, stable=base,
            result=FAIL if fail else PASS,
        ))  # fmt: skip
        failed += ["ttftP95"] if fail else []
    text = "; ".join(describe(v) for v in out) or "the devices report no KPIs yet"
    if failed:
        return Verdict(FAIL, out, text)
    return Verdict(PASS, out, text)


class PrometheusWindows(WindowSource):
    """From Prometheus: ``increase`` over the window, summed over the gateways of one
    LLMService (series labelled ``namespace`` and ``llmservice``)."""

    def __init__(self, url: str, namespace: str, llmservice: str) -> None:
        self.url = url.rstrip("/")
        self.selector = f'namespace="{namespace}",llmservice="{llmservice}"'

    def _query(self, expr: str, at: float) -> list[dict[str, object]]:
        return prometheus_get(self.url, "/api/v1/query", {"query": expr, "time": f"{at:.3f}"})

    def read(self, start: float | None, now: float) -> Window:
        sel = self.selector
        attempts: list[dict[str, object]] = []
        hists: dict[str, list[dict[str, object]]] = {}
        try:
            if start is not None:  # a window to judge, not only the routing to see
                span = max(1, round(now - start))
                attempts = self._query(
                    f"sum by (tier, revision, result) (increase({names.GATEWAY_REVISION_ATTEMPTS_TOTAL}{{{sel}}}[{span}s]))",
                    now,
                )
                hists = {
                    attr: self._query(
                        f"sum by (tier, revision, le) (increase({metric}_bucket{{{sel}}}[{span}s]))",
                        now,
                    )
                    for attr, metric in (
                        ("ttft", names.GATEWAY_REVISION_TTFT_SECONDS),
                        ("tpot", names.GATEWAY_REVISION_TPOT_SECONDS),
                    )
                }
            healthy = self._query(
                f"min by (tier, revision) ({names.GATEWAY_REVISION_HEALTHY_BACKENDS}{{{sel}}})", now
            )
            gateways = self._query(f"count({names.GATEWAY_ROUTING_GENERATION}{{{sel}}})", now)
            golden_metric = f"{names.GATEWAY_REVISION_GOLDEN_PASSED}{{{sel}}}"
            golden = self._query(f"min by (tier, revision, prompt) ({golden_metric})", now)
            golden_asked = self._query(f"count by (tier, revision, prompt) ({golden_metric})", now)
            generation = self._query(f"min({names.GATEWAY_ROUTING_GENERATION}{{{sel}}})", now)
        except PrometheusError as exc:
            return Window(problem=str(exc))
        window = Window(
            gateways=int(float(gateways[0]["value"][1])) if gateways else 0,  # type: ignore[index]
            generation=float(generation[0]["value"][1]) if generation else 0.0,  # type: ignore[index]
        )

        def key(series: dict[str, object]) -> tuple[str, str]:
            m = series["metric"]
            assert isinstance(m, dict)
            return str(m.get("tier", "")), str(m.get("revision", ""))

        def value(series: dict[str, object]) -> float:
            return float(series["value"][1])  # type: ignore[index]

        for s in attempts:
            w = window.revisions.setdefault(key(s), RevisionWindow())
            result = s["metric"].get("result")  # type: ignore[attr-defined]
            if result == "error":
                w.errors += value(s)
            else:
                w.ok += value(s)
        for attr, series in hists.items():
            for s in series:
                w = window.revisions.setdefault(key(s), RevisionWindow())
                le = float(s["metric"]["le"])  # type: ignore[index]
                getattr(w, attr)[le] = value(s)
        window.healthy = {key(s): value(s) for s in healthy}

        def prompt(series: dict[str, object]) -> tuple[str, str, int]:
            m = series["metric"]
            assert isinstance(m, dict)
            return (*key(series), int(m.get("prompt", 0)))

        asked = {prompt(s): value(s) for s in golden_asked}
        window.golden = {
            prompt(s): value(s) for s in golden if asked.get(prompt(s), 0) >= window.gateways
        }
        return window
