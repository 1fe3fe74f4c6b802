"""The token server as a replica with a capacity (the autoscaling benchmark's replicas):
``--max-concurrency`` answers that many requests at once and queues the rest in order,
``--startup-s`` answers 503 "loading" with Retry-After until its load time has passed.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai

from .conftest import MODEL, TOKENSERVER, free_port


def _wait(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_max_concurrency_queues_requests_beyond_the_slots_in_arrival_order(procs: Any) -> None:
    # one slot; each answer takes 0.1 + 4 / 10 = 0.5 s
    server = procs.tokenserver("slot", "--max-concurrency", "1", "--rate", "10",
                               "--ttft-s", "0.1")  # fmt: skip
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    first_token: dict[int, float] = {}
    started = time.monotonic()

    def ask(i: int) -> None:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and i not in first_token:
                first_token[i] = time.monotonic() - started

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        _wait(lambda n=i + 1: server.stats()["requests"] == n, f"request {i} to arrive")
    stats = server.stats()
    assert (stats["in_flight"], stats["waiting"]) == (1, 2), stats
    for t in threads:
        t.join(timeout=30)
    assert sorted(first_token) == [0, 1, 2]
    # served one after another, in the order they came: each waited for the ones before
    assert first_token[0] < first_token[1] < first_token[2]
    assert first_token[2] - first_token[0] >= 2 * 0.5 - 0.05
    stats = server.stats()
    assert (stats["completed"], stats["in_flight"], stats["waiting"]) == (3, 0, 0), stats


def test_startup_answers_loading_with_retry_after_then_serves(tmp_path: Any) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, str(TOKENSERVER), "--port", str(port),
         "--model", MODEL, "--startup-s", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        health: httpx.Response | None = None

        def answers() -> bool:
            nonlocal health
            try:
                health = httpx.get(url + "/health", timeout=1.0)
            except httpx.TransportError:
                return False
            return True

        _wait(answers, "the server to listen")
        assert health is not None
        assert health.status_code == 503, health.text
        assert 1 <= int(health.headers["Retry-After"]) <= 8
        answer = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "model_not_ready"
        assert "loading" in error["message"]
        _wait(lambda: httpx.get(url + "/health", timeout=1.0).status_code == 200, "loaded")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_negative_concurrency_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, str(TOKENSERVER), "--max-concurrency", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "must be 0 or more" in out.stderr


def test_serial_prefill_holds_every_streams_decoding_while_a_prompt_prefills(procs: Any) -> None:
    """--serial-prefill: the autoscaling benchmark's engine replica (one prompt at a time,
    no stream decodes meanwhile), the replica the capacity model describes."""
    server = procs.tokenserver("engine", "--serial-prefill", "--prefill-rate", "200",
                               "--rate", "50")  # fmt: skip
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    arrivals: list[float] = []

    def decode() -> None:  # a short prompt, a long answer: a token each 20 ms
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())

    decoding = threading.Thread(target=decode)
    decoding.start()
    _wait(lambda: len(arrivals) >= 3, "the first stream to decode")
    sent = time.monotonic()
    long_prompt = [{"role": "user", "content": "x" * 800}]  # ~205 tokens: ~1 s of prefill
    stream = client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=2,
                                            stream=True)  # fmt: skip
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    ttft = time.monotonic() - sent
    assert first.choices[0].delta.content
    decoding.join(timeout=30)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert ttft >= 0.9, ttft  # the prompt's tokens at 200/s
    assert max(gaps) >= 0.8, gaps  # the first stream held while the prompt prefilled
    assert sorted(gaps)[len(gaps) // 2] < 0.1  # and otherwise a token each 20 ms
