"""The metrics catalogue, the dashboards and the alerts, checked without a cluster: every
query parsed by a real Prometheus and held to the rules in `promql`, every generated file
current, and the operator's collector exporting a real autoscaler's decisions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import crd
from hybridllm_common import metrics as names
from hybridllm_operator.observability import alerts, catalogue, generate, grafana, panels
from hybridllm_operator.observability import metrics as control_metrics

from . import promql
from .conftest import scaled_service

ROOT = Path(__file__).resolve().parents[2]
VALUES = {"namespace": "ns", "llmservice": "svc", "pool": "edge", "fleet": "f"}


@pytest.fixture(scope="module")
def prometheus(testenv: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus (no targets) with the generated alerts loaded: its parser is the
    judge of every query."""
    state = tmp_path_factory.mktemp("prometheus")
    url = testenv.prometheus_up(state, rule_files=[ROOT / generate.ALERTS_FILE])
    try:
        yield url
    finally:
        testenv.stop(state, "prometheus")


@pytest.fixture(scope="module")
def families() -> dict[str, catalogue.Entry]:
    return catalogue.series(catalogue.catalogue())


def _every_query() -> list[tuple[str, str]]:
    out = [(f"{d.uid}: {p.title}", q.expr) for d in panels.DASHBOARDS for p in d.panels
           for q in p.queries]  # fmt: skip
    out += [(f"{d.uid}: annotation", a.expr) for d in panels.DASHBOARDS for a in d.annotations]
    out += [(f"alert {r['alert']}", r["expr"]) for g in alerts.groups() for r in g["rules"]]
    return out


def test_every_metric_is_named_by_the_conventions() -> None:
    entries = catalogue.catalogue()
    assert catalogue.problems(entries) == []
    # the checks can fail: a gauge named like a counter, a counter without _total
    bad = [
        catalogue.Entry("hybridllm_x_total", "gauge", (), "x", "t"),
        catalogue.Entry("hybridllm_y", "counter", (), "y", "t"),
        catalogue.Entry("z_seconds", "histogram", (), "", "t"),
    ]
    assert len(catalogue.problems(bad)) == 4
    components = {e.component for e in entries}
    assert components == {"gateway", "cloud runtime", "edge runtime", "operator", "fleet server"}


def test_the_generated_files_are_current() -> None:
    """docs/metrics.md, the chart's dashboards and alerts: what the code generates now."""
    stale = [
        str(rel) for rel, text in generate.outputs().items()
        if not (ROOT / rel).exists() or (ROOT / rel).read_text() != text
    ]  # fmt: skip
    assert stale == [], "run `hybridllm observability generate`"


def test_every_query_parses_and_keeps_the_rules(
    prometheus: str, families: dict[str, catalogue.Entry]
) -> None:
    queries = _every_query()
    assert len(queries) > 40
    found = {}
    for where, expr in queries:
        ast = promql.parse(prometheus, panels.render(expr, VALUES))
        found[where + " " + expr] = promql.problems(ast, families)
    assert {k: v for k, v in found.items() if v} == {}


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        # production-stack's average latency: lifetime sums over lifetime counts
        (f"{names.E2E_REQUEST_LATENCY_SECONDS}_sum / {names.E2E_REQUEST_LATENCY_SECONDS}_count",
         "read without rate"),
        # llm-d's TTFT quantile: no sum by (le)
        (f"histogram_quantile(0.9, rate({names.TIME_TO_FIRST_TOKEN_SECONDS}_bucket[5m]))",
         "histogram_quantile not over"),
        # a quantile summed away from its buckets
        (f"histogram_quantile(0.9, sum by (tier) (rate({names.TIME_TO_FIRST_TOKEN_SECONDS}"
         "_bucket[5m])))", "histogram_quantile not over"),
        (f"sum({names.GATEWAY_REQUESTS_TOTAL})", "read without rate"),
        (f"rate({names.GATEWAY_OUTSTANDING_REQUESTS}[5m])", "not a counter"),
        ("rate(hybridllm_no_such_metric_total[5m])", "not in the metrics catalogue"),
    ],
)  # fmt: skip
def test_the_rules_catch_the_known_dashboard_bugs(
    prometheus: str, families: dict[str, catalogue.Entry], expr: str, problem: str
) -> None:
    found = promql.problems(promql.parse(prometheus, expr), families)
    assert any(problem in p for p in found), found


def test_a_query_prometheus_cannot_parse_is_refused(prometheus: str) -> None:
    with pytest.raises(promql.ParseError, match="parse error"):
        promql.parse(prometheus, "sum(rate(x[5m])")


def test_the_dashboards_are_grafana_models_with_a_data_source_variable() -> None:
    for d in panels.DASHBOARDS:
        model = grafana.build(d)
        assert model["uid"] == d.uid
        variables = [v["name"] for v in model["templating"]["list"]]
        assert variables == ["datasource", *d.variables]
        assert all(p["datasource"]["uid"] == "${datasource}" for p in model["panels"])
        assert len(model["panels"]) == len(d.panels)
        # panels tile the 24-column grid without overlapping
        cells = set()
        for p in model["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, p["title"]
                    cells.add((x, y))
    band = next(p for p in grafana.build(panels.AUTOSCALING)["panels"] if "forecast" in p["title"])
    upper = next(o for o in band["fieldConfig"]["overrides"]
                 if o["matcher"]["options"] == "forecast P90")  # fmt: skip
    assert {"id": "custom.fillBelowTo", "value": "forecast P50"} in upper["properties"]


def _scrape(m: control_metrics.OperatorMetrics) -> dict[tuple[str, frozenset[Any]], float]:
    text = generate_latest(m.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_the_operator_exports_what_the_autoscaler_decided() -> None:
    view = scaled_service()
    spec, scaling = view.spec, view.scaling
    assert spec is not None
    assert scaling is not None
    views = [view]
    exported = control_metrics.OperatorMetrics(lambda: views)
    pool = frozenset({("namespace", "ns"), ("llmservice", "svc"), ("pool", "edge")})
    got = _scrape(exported)
    desired = got[(names.AUTOSCALER_DESIRED_REPLICAS, pool)]
    assert desired == scaling.desired["edge"] > 1  # the load needs more than one replica
    assert got[(names.AUTOSCALER_SCALE_EVENTS_TOTAL, pool | {("direction", "up")})] >= 1
    assert got[(names.AUTOSCALER_REPLICA_SECONDS_TOTAL, pool)] == pytest.approx(10.0)
    target = scaling.scalers["edge"].pool.target_utilisation
    demand = got[(names.AUTOSCALER_DEMAND_REPLICAS, pool)]
    assert demand == pytest.approx(scaling.demand["edge"] / target)
    cause = scaling.decisions["edge"].cause
    assert cause in ("scale up: measured load", "hold: measured load")  # no numbers
    assert got[(names.AUTOSCALER_DECISION_INFO, pool | {("cause", cause)})] == 1
    assert got[(names.SERVICE_SLO_TTFT_SECONDS, pool - {("pool", "edge")})] == (
        spec.slo.ttft_p95_seconds
    )
    # a service gone from the views is gone from the metrics
    views.clear()
    assert not any(name.startswith("hybridllm_autoscaler") for name, _ in _scrape(exported))


def test_the_operator_exports_the_rollout_state() -> None:
    state = crd.RolloutStatus.model_validate({
        "phase": "Progressing", "stableRevision": "v1", "canaryRevision": "v2", "step": 1,
        "steps": 3, "weight": 20, "weights": {"edge": 20},
        "analysis": [{"metric": "errorRate", "tier": "edge", "canary": 0.01, "stable": 0.0,
                      "result": "fail"}],
    })  # fmt: skip
    exported = control_metrics.OperatorMetrics(
        lambda: [control_metrics.ServiceView("ns", "svc", rollout=state)]
    )
    got = _scrape(exported)
    svc = frozenset({("namespace", "ns"), ("llmservice", "svc")})
    assert got[(names.ROLLOUT_PHASE, svc | {("phase", "Progressing")})] == 1
    assert got[(names.ROLLOUT_PHASE, svc | {("phase", "Completed")})] == 0
    assert got[(names.ROLLOUT_STEP, svc)] == 1
    assert got[(names.ROLLOUT_CANARY_WEIGHT, svc | {("tier", "edge")})] == 20
    verdict = svc | {("metric", "errorRate"), ("tier", "edge")}
    assert got[(names.ROLLOUT_ANALYSIS_VALUE, verdict | {("role", "canary")})] == 0.01
    assert got[(names.ROLLOUT_ANALYSIS_RESULT, verdict | {("result", "fail")})] == 1


def test_prometheus_loads_every_alert(prometheus: str) -> None:
    """The generated rules file, loaded by the real Prometheus the fixture started with
    it: every group and rule is there, none in error."""
    import httpx

    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    wanted = [r["alert"] for g in alerts.groups() for r in g["rules"]]
    assert sorted(loaded) == sorted(wanted)
    assert len(wanted) >= 8
    assert all(r["health"] != "err" for r in loaded.values()), loaded
