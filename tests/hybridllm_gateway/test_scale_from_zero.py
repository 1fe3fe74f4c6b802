"""A tier scaled to zero: the gateway holds its requests (counted, so the autoscaler wakes
the pool) until a replica answers, within a bounded queue and a deadline."""

from __future__ import annotations

import threading
import time

import httpx

from hybridllm_operator.llmservice import demand

from .conftest import chat, free_port


def _held(gw_url: str) -> float:
    sample = demand.parse_gateway_metrics(demand._http_get(gw_url + "/metrics"), 0.0)
    return sample.held.get("edge", 0.0)


def _wait(check, timeout_s: float = 30.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_request_for_a_tier_at_zero_waits_for_its_first_replica(procs, table):
    port = free_port()  # where the replica will listen; nothing does yet
    routing = table(edge=[f"http://127.0.0.1:{port}"], policy="edge-only")
    routing["tiers"]["edge"]["scaleFromZero"] = True
    gw = procs.gateway(routing, "--hold-timeout-s", "60")
    answers: list[httpx.Response] = []
    asker = threading.Thread(target=lambda: answers.append(chat(gw.url, max_tokens=3)))
    asker.start()
    _wait(lambda: _held(gw.url) == 1, what="the request held")
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'hybridllm_gateway_cold_requests_total{tier="edge"} 1.0' in metrics
    # what the autoscaler reads: one request waiting for the edge tier
    snap = demand.GatewayScrape(lambda: [gw.url + "/metrics"])
    snap.read(0.0)
    assert snap.read(1.0).tiers["edge"].waiting >= 1
    server = procs.tokenserver_on(port, "edge-a")
    asker.join(timeout=60)
    assert answers, "the held request never finished"
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["system_fingerprint"] == "edge-a"
    assert _held(gw.url) == 0
    server.kill()


def test_no_replica_in_time_or_a_full_queue_is_503_with_retry_after(procs, table):
    port = free_port()
    routing = table(edge=[f"http://127.0.0.1:{port}"], policy="edge-only")
    routing["tiers"]["edge"]["scaleFromZero"] = True
    gw = procs.gateway(routing, "--hold-timeout-s", "3", "--max-held-requests", "1")
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(chat(gw.url)))
    first.start()
    _wait(lambda: _held(gw.url) == 1, what="the first request held")
    full = chat(gw.url)  # the queue holds one: the second is refused at once
    assert full.status_code == 503
    assert full.headers["retry-after"] == "10"
    assert "already wait" in full.json()["error"]["message"]
    first.join(timeout=30)
    late = answers[0]
    assert late.status_code == 503
    assert int(late.headers["retry-after"]) > 0
    assert "no replica became ready within 3 s" in late.json()["error"]["message"]


def test_a_tier_that_cannot_scale_to_zero_is_not_held(procs, table):
    port = free_port()
    gw = procs.gateway(table(edge=[f"http://127.0.0.1:{port}"], policy="edge-only"))
    r = chat(gw.url)
    assert r.status_code == 502
    assert _held(gw.url) == 0
