"""PromQL checked by Prometheus's own parser (``/api/v1/parse_query`` of a real server): the
rules every dashboard panel and alert is held to.

- every selected series is in the metrics catalogue (docs/metrics.md);
- a counter (``_total``, a histogram's ``_bucket``/``_sum``/``_count``) is read only
  through ``rate``/``increase``/``irate``, and those read only counters;
- ``histogram_quantile`` is taken over ``sum by (le, ...) (rate(..._bucket[...]))``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from hybridllm_operator.observability import catalogue

RATES = {"rate", "increase", "irate"}


class ParseError(ValueError):
    pass


def parse(prometheus: str, expr: str) -> dict[str, Any]:
    r = httpx.post(f"{prometheus}/api/v1/parse_query", data={"query": expr}, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise ParseError(f"{body.get('error')}: {expr}")
    return body["data"]  # type: ignore[no-any-return]


def _counter(series: str, families: dict[str, catalogue.Entry]) -> bool:
    entry = families.get(series)
    if entry is None:
        return False
    return entry.type == "counter" or (
        entry.type in ("histogram", "summary") and series != entry.name
    )


def problems(ast: dict[str, Any], families: dict[str, catalogue.Entry]) -> list[str]:
    """What breaks the rules in one parsed expression."""
    out: list[str] = []

    def walk(node: dict[str, Any], parent: dict[str, Any] | None) -> None:
        kind = node.get("type")
        if kind in ("vectorSelector", "matrixSelector"):
            name = node.get("name") or ""
            if name not in families:
                out.append(f"{name!r} is not in the metrics catalogue")
            counter = _counter(name, families)
            rated = (
                kind == "matrixSelector"
                and parent is not None
                and parent.get("type") == "call"
                and parent["func"]["name"] in RATES
            )
            if counter and not rated:
                out.append(f"counter {name!r} read without rate()/increase()")
            if rated and not counter and name in families:
                out.append(f"rate()/increase() of {name!r}, which is not a counter")
            if kind == "matrixSelector" and "vectorSelector" in node:  # older AST shape
                walk(node["vectorSelector"], node)
            return
        if kind == "call" and node["func"]["name"] == "histogram_quantile":
            inner = node["args"][1]
            while inner.get("type") == "parenExpr":
                inner = inner["expr"]
            ok = (
                inner.get("type") == "aggregation"
                and inner.get("op") == "sum"
                and not inner.get("without")
                and "le" in (inner.get("grouping") or [])
                and inner["expr"].get("type") == "call"
                and inner["expr"]["func"]["name"] in RATES
                and str(inner["expr"]["args"][0].get("name", "")).endswith("_bucket")
            )
            if not ok:
                out.append("histogram_quantile not over sum by (le) (rate(..._bucket[...]))")
        for key in ("expr", "lhs", "rhs", "param"):
            child = node.get(key)
            if isinstance(child, dict):
                walk(child, node)
        for child in node.get("args") or []:
            walk(child, node)

    walk(ast, None)
    return out


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result (raises on an error answer)."""
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        raise ParseError(f"{body.get('error')}: {expr}")
    result = body["data"]["result"]
    return result if isinstance(result, list) else [result]


def without_data(
    prometheus: str,
    dashboard: Any,
    values: dict[str, str],
    titles: set[str] | None = None,
    rate: str = "10s",
    range_: str = "5m",
) -> list[str]:
    """The dashboard's queries (of the panels titled ``titles``; None: all) that return no
    series from this Prometheus now, as "panel: query"."""
    from hybridllm_operator.observability import panels

    out = []
    for p in dashboard.panels:
        if titles is not None and p.title not in titles:
            continue
        for q in p.queries:
            expr = panels.render(q.expr, values, rate=rate, range_=range_)
            if not query(prometheus, expr):
                out.append(f"{p.title}: {expr}")
    return out


def wait_for_data(
    prometheus: str,
    dashboards: list[tuple[Any, set[str] | None]],
    values: dict[str, str],
    timeout: float,
    range_: str = "5m",
    skip: str | None = None,
) -> list[str]:
    """Polls (each scrape is a second apart) until every query of the dashboards' panels
    (those titled in each set; None: all) returns data, or ``timeout`` passes; returns
    those still without data (skipping queries that contain ``skip``)."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [
            m
            for dashboard, titles in dashboards
            for m in without_data(prometheus, dashboard, values, titles, range_=range_)
            if skip is None or skip not in m
        ]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.5)
