"""Demand read from a Prometheus server's HTTP API (the operator's ``prometheusUrl``):
`PrometheusDemand` of one LLMService, and the `PrometheusBatch` of queries every
LLMService's reader shares.

The gateway's series must carry the labels ``namespace`` and ``llmservice`` (the chart's
scrape config relabels them from the pod's namespace and its ``app.kubernetes.io/instance``
label). The history the forecast needs comes from a range query, so a restarted operator
has it at once. `prometheus_get` is one query, also used by the rollout's analysis.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from hybridllm_common import metrics as names
from hybridllm_common.speed import REFERENCE_LOAD, TierSpeed
from hybridllm_operator.llmservice.demand.common import (
    HTTP_TIMEOUT_S,
    OFFERED_COMPLETION,
    OFFERED_PROMPT,
    TIERS,
    TTFT_QUANTILE,
    DemandSource,
    Snapshot,
    TierDemand,
)

MAX_RANGE_POINTS = 10_000  # Prometheus refuses range queries of more than 11,000 points


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return str(response.read().decode())


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
            # the saturation signals that are counts: 503s answered for the tier, and its
            # attempts that timed out before a first byte (one query, a "figure" label each)
            "failures": " or ".join(
                f"label_replace(sum by ({by}tier) (increase({metric}{{{sel},{match}}}[{w}])), "
                f'"figure", "{figure}", "", "")'
                for figure, metric, match in (
                    ("overloaded", names.GATEWAY_REQUESTS_TOTAL, 'code="503"'),
                    (
                        "timed_out",
                        names.GATEWAY_UPSTREAM_ERRORS_TOTAL,
                        f'kind="{names.UpstreamErrorKind.TIMEOUT}"',
                    ),
                )
            ),
            "ttft": (
                f"histogram_quantile({TTFT_QUANTILE}, sum by ({by}tier, le) "
                f"(rate({names.TIME_TO_FIRST_TOKEN_SECONDS}_bucket{{{sel}}}[{w}])))"
            ),
            # the replicas' learned speed (capacity: auto), four figures in one query, each
            # tagged by a "figure" label
            "speed": " or ".join(
                f'label_replace({agg} by ({by}tier) ({metric}{{{sel}{extra}}}), "figure", '
                f'"{figure}", "", "")'
                for figure, agg, metric, extra in (
                    ("prefill", "avg", names.GATEWAY_REPLICA_PREFILL_TOKENS_PER_SECOND, ""),
                    ("tpot_1", "avg", names.GATEWAY_REPLICA_OUTPUT_SECONDS, ',load="1"'),
                    (
                        "tpot_ref",
                        "avg",
                        names.GATEWAY_REPLICA_OUTPUT_SECONDS,
                        f',load="{REFERENCE_LOAD}"',
                    ),
                    ("answers", "sum", names.GATEWAY_REPLICA_ANSWERS_TOTAL, ""),
                )
            ),
        }

    def _by_tier(self, name: str, at: float) -> dict[str, float]:
        """One instant query's value per tier: from the batch's answer over every
        LLMService, or asked for this one alone."""
        return {
            str(r["metric"].get("tier", "")): float(r["value"][1]) for r in self._rows(name, at)
        }

    def _figures(self, name: str, at: float) -> dict[str, dict[str, float]]:
        """A query of several figures (each tagged by its "figure" label): tier -> figure ->
        value, the values that are numbers."""
        figures: dict[str, dict[str, float]] = {}
        for r in self._rows(name, at):
            value = float(r["value"][1])
            if math.isfinite(value):
                tier = str(r["metric"].get("tier", ""))
                figures.setdefault(tier, {})[str(r["metric"].get("figure"))] = value
        return figures

    def _speeds(self, at: float) -> dict[str, TierSpeed]:
        """Each tier's learned speed (the "speed" query's figures)."""
        figures = self._figures("speed", at)
        return {
            tier: TierSpeed(f.get("prefill"), f.get("tpot_1"), f.get("tpot_ref"),
                            f.get("answers", 0.0))
            for tier, f in figures.items()
        }  # fmt: skip

    def _rows(self, name: str, at: float) -> list[dict[str, Any]]:
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
        return rows

    def read(self, now_s: float) -> Snapshot:
        w = f"{int(self.rate_window_s)}s"
        sel = self.selector
        # the evaluation time every reader of one boundary shares (see PrometheusBatch)
        at = math.floor(now_s / EVAL_QUANTUM_S) * EVAL_QUANTUM_S if self.batch else now_s
        problems: dict[str, str] = {}
        try:
            prompt, completion, in_flight, waiting, ttft = (
                self._by_tier(name, at)
                for name in ("prompt", "completion", "in_flight", "waiting", "ttft")
            )
            failures = self._figures("failures", at)
            speeds = self._speeds(at)
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
                counts = failures.get(tier, {})
                tiers[tier] = TierDemand(
                    p,
                    c,
                    in_flight.get(tier, 0.0),
                    q if q is not None and math.isfinite(q) else None,
                    held if math.isfinite(held) else 0.0,
                    counts.get("overloaded", 0.0),
                    speeds.get(tier),
                    counts.get("timed_out", 0.0),
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
