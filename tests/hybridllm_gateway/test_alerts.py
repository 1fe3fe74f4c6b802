"""The alerting rules evaluated by a real Prometheus on a real gateway's series: a service
whose every answer is a 5xx (the gateway's 502 for a failing upstream) burns its error
budget, and the fast burn-rate alert goes pending for it (its `for` then decides when it
fires); a healthy one does not."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hybridllm_operator.observability import generate

from .conftest import MODEL

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


def test_a_failing_service_burns_its_budget_and_a_healthy_one_does_not(
    testenv: Any, procs: Any, table: Any, prometheus: tuple[str, Path]
) -> None:
    url, state = prometheus
    bad_backend = procs.tokenserver("bad", "--fail-status", "500")
    good_backend = procs.tokenserver("good", "--rate", "1000")
    bad = procs.gateway(table(cloud=[bad_backend.url]), name="bad.json")
    good = procs.gateway(table(cloud=[good_backend.url]), name="good.json")
    testenv.prometheus_targets(state, [
        (bad.url.removeprefix("http://"), {"namespace": "shop", "llmservice": "broken"}),
        (good.url.removeprefix("http://"), {"namespace": "shop", "llmservice": "fine"}),
    ])  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 60
    firing: list[dict[str, Any]] = []
    with httpx.Client(timeout=10) as client:
        while time.monotonic() < deadline:
            assert client.post(f"{bad.url}/v1/chat/completions", json=body).status_code >= 500
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
    assert firing[0]["state"] in ("pending", "firing")
    assert firing[0]["labels"]["severity"] == "critical"
    assert firing[0]["annotations"]["summary"] == "shop/broken burns its error budget 14x too fast"
