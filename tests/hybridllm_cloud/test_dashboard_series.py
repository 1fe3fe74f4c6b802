"""The service dashboard's runtime panels (queue depth, KV cache use) against a real cloud
runtime with the real model, scraped by a real Prometheus under concurrent requests: the
series the queries select exist and answer, as the chart's PodMonitor labels them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from hybridllm_operator.observability import panels

from ..hybridllm_operator import promql
from .test_disagg_processes import _start

pytestmark = pytest.mark.slow
LABELS = {"namespace": "ns", "llmservice": "svc", "component": "monolithic"}
RUNTIME_PANELS = ("Queue depth", "KV cache use")


@pytest.fixture
def scraped_runtime(
    testenv: Any, real_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[str, str]]:
    proc, url = _start(["--model", str(real_model_dir)], tmp_path / "runtime.log")
    try:
        prometheus = testenv.prometheus_up(tmp_path / "prometheus-state")
        try:
            testenv.prometheus_targets(
                tmp_path / "prometheus-state", [(url.removeprefix("http://"), LABELS)]
            )
            yield url, prometheus
        finally:
            testenv.stop(tmp_path / "prometheus-state", "prometheus")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_runtime_panels_answer_from_a_real_runtime(scraped_runtime: tuple[str, str]) -> None:
    url, prometheus = scraped_runtime
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    values = {"namespace": LABELS["namespace"], "llmservice": LABELS["llmservice"]}
    done = threading.Event()

    def ask() -> None:
        while not done.is_set():
            client.completions.create(model="smollm2", prompt="Count to ten:", max_tokens=24)

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        missing = promql.wait_for_data(
            prometheus, [(panels.SERVICE, set(RUNTIME_PANELS))], values, timeout=60,
            # the queue panel's second query is the gateway's (tests/hybridllm_operator)
            skip="gateway_outstanding",
        )  # fmt: skip
    finally:
        done.set()
        for t in threads:
            t.join(timeout=300)
    assert missing == []
    kv = next(p for p in panels.SERVICE.panels if p.title == "KV cache use").queries[0]
    used = promql.query(prometheus, panels.render(kv.expr, values))
    assert used[0]["metric"] == {"component": "monolithic"}
    assert 0.0 <= float(used[0]["value"][1]) <= 1.0
