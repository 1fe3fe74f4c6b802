"""Retries past a killed replica, ejection, and routing reloads under load."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest


def test_killed_replica_is_retried_and_ejected(procs, table, ask) -> None:
    a, b = procs.tokenservers(["cloud-a", "cloud-b"])
    gw = procs.gateway(table(cloud=[a.url, b.url]))
    a.kill()
    answers = [ask(gw.url, "hi", headers={"x-session-id": f"s{i}"}) for i in range(20)]
    assert [r.status_code for r in answers] == [200] * 20
    assert {r.json()["system_fingerprint"] for r in answers} == {"cloud-b"}
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'hybridllm_gateway_ejections_total{tier="cloud"} 1.0' in metrics
    # ejected after 3 connection failures: the rest went straight to cloud-b
    assert 'hybridllm_gateway_upstream_errors_total{kind="connect",tier="cloud"} 3.0' in metrics
    b.kill()
    r = ask(gw.url, "hi")
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    # no backend left: once both are ejected /health says so, but the gateway itself stays
    # ready (its pods keep answering, and the autoscaler keeps reading the demand)
    for _ in range(3):
        assert ask(gw.url, "hi").status_code == 502
    assert httpx.get(gw.url + "/health").status_code == 503
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["healthy_replicas"] == {"cloud": 0}
    assert "hybridllm_gateway_requests_total{" in httpx.get(gw.url + "/metrics").text


def test_5xx_before_first_byte_is_retried_on_another_replica(procs, table, ask) -> None:
    bad = procs.tokenserver("cloud-bad", "--fail-status", "503")
    good = procs.tokenserver("cloud-good")
    gw = procs.gateway(table(cloud=[bad.url, good.url]))
    answers = [ask(gw.url, "hi", stream=i % 2 == 0) for i in range(10)]
    assert all(r.status_code == 200 for r in answers)


def test_a_busy_replica_is_skipped_not_ejected_and_all_busy_is_503_with_retry_after(
    procs, table, ask
) -> None:
    """A 503 with Retry-After (a full queue, a model still loading) is a healthy replica
    that is busy: the request goes to another, and the replica is not ejected (that would
    take capacity away when it is short). When every replica is busy the client gets 503
    server_overloaded with the Retry-After."""
    busy = procs.tokenserver("cloud-busy", "--fail-status", "503", "--retry-after", "7")
    good = procs.tokenserver("cloud-good")
    gw = procs.gateway(table(cloud=[busy.url, good.url]))
    answers = [
        ask(gw.url, "hi", stream=i % 2 == 0, headers={"x-session-id": f"s{i}"}) for i in range(40)
    ]
    assert [r.status_code for r in answers] == [200] * 40
    # about half the sessions hash to the busy replica first: it is asked each time, past
    # the 3 consecutive failures that would eject it for 5 s (longer than this loop)
    assert busy.stats()["requests"] > 3
    metrics = httpx.get(gw.url + "/metrics").text
    assert "hybridllm_gateway_ejections_total{" not in metrics
    busy_line = 'hybridllm_gateway_upstream_errors_total{kind="busy",tier="cloud"} '
    assert f"{busy_line}{float(busy.stats()['requests'])}" in metrics

    only_busy = procs.gateway(table(cloud=[busy.url]), name="busy.json")
    for stream in (False, True):
        r = ask(only_busy.url, "hi", stream=stream)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "server_overloaded"
        assert r.headers["retry-after"] == "7"
    assert "is busy" in r.json()["error"]["message"]


def test_reload_under_load_drops_no_request(procs, table, tmp_path) -> None:
    old, new = procs.tokenservers(["old", "new"], "--rate", "200")
    gw = procs.gateway(table(edge=[old.url]))
    config = tmp_path / "routing.json"
    payload = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    stop = threading.Event()

    def client() -> list[int]:
        codes = []
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                codes.append(c.post(gw.url + "/v1/chat/completions", json=payload).status_code)
        return codes

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client) for _ in range(8)]
        # the kubelet's way: write a new file, swap it in with a rename
        for i in range(6):
            target = new if i % 2 == 0 else old
            staged = tmp_path / f"routing.{i}.json"
            staged.write_text(json.dumps(table(edge=[target.url])))
            os.replace(staged, config)
            deadline = 300
            while (
                deadline
                and httpx.get(gw.url + "/metrics").text.count(
                    f"hybridllm_gateway_config_reloads_total {i + 1}.0"
                )
                == 0
            ):
                deadline -= 1
            assert deadline, f"reload {i + 1} not seen"
        stop.set()
        codes = [c for f in futures for c in f.result()]
    assert len(codes) > 50
    assert set(codes) == {200}
    assert old.stats()["completed"] > 0
    assert new.stats()["completed"] > 0
    with httpx.Client() as c:
        r = c.post(gw.url + "/v1/chat/completions", json=payload)
    assert r.json()["system_fingerprint"] == "old"  # the last table named `old`


@pytest.mark.parametrize("relay_mode", ["raw", "aiohttp"])
def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error(procs, table, relay_mode) -> None:
    """The client of a cut stream must learn that its answer is incomplete: an SSE error
    event (the openai SDK raises it), never a stream that ends as if it were whole."""
    slow = procs.tokenserver("cloud-slow", "--rate", "20")
    gw = procs.gateway(table(cloud=[slow.url]), "--stream-relay", relay_mode)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=200, stream=True
    )
    received = []

    def consume() -> None:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content)
            if len(received) == 3:
                slow.kill()

    with pytest.raises(openai.APIError) as caught:
        consume()
    assert len(received) >= 3
    assert "failed mid-stream" in str(caught.value)
    assert "not a complete answer" in str(caught.value)
