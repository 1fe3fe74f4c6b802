"""The response cache through the server: identical answers, streamed hits, never for sampling."""

from __future__ import annotations

import httpx


def _counter(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_repeated_greedy_question_is_served_from_cache(llamacpp_server) -> None:
    client = llamacpp_server.client()
    base = llamacpp_server.base_url
    hits = _counter(base, "hybridllm_response_cache_hits_total")
    ask = dict(model="", max_tokens=10, temperature=0)
    first = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "Which planet is the largest?"}], **ask
    )
    again = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "  Which planet   is the largest? "}], **ask
    )
    assert first.headers["x-hybridllm-cache"] == "miss"
    assert again.headers["x-hybridllm-cache"] == "hit"
    a, b = first.parse(), again.parse()
    assert b.choices[0].message.content == a.choices[0].message.content
    assert b.usage.completion_tokens == a.usage.completion_tokens
    assert again.headers["x-hybridllm-mean-logprob"] == first.headers["x-hybridllm-mean-logprob"]
    assert _counter(base, "hybridllm_response_cache_hits_total") == hits + 1

    streamed = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "Which planet is the largest?"}], stream=True, **ask
    )
    assert streamed.headers["x-hybridllm-cache"] == "hit"
    chunks = list(streamed.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 2  # replayed piece by piece, not as one blob
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == a.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == a.choices[0].finish_reason

    other = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "Which planet is the largest?"}],
        model="",
        max_tokens=11,
        temperature=0,
    )
    assert other.headers["x-hybridllm-cache"] == "miss"  # other sampling parameters, other key


def test_sampled_requests_never_come_from_the_cache(llamacpp_server) -> None:
    client = llamacpp_server.client()
    cache = llamacpp_server.app.state.cache
    size = len(cache)
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="",
            messages=[{"role": "user", "content": "Say something random."}],
            max_tokens=6,
            temperature=0.9,
        )
        assert raw.headers["x-hybridllm-cache"] == "bypass"
    assert len(cache) == size
    # n > 1 and logprobs are never cached either
    raw = client.chat.completions.with_raw_response.create(
        model="",
        messages=[{"role": "user", "content": "Say something random."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
    )
    assert raw.headers["x-hybridllm-cache"] == "bypass"


def test_sampled_request_may_opt_in(llamacpp_server) -> None:
    client = llamacpp_server.client()
    ask = dict(
        model="",
        messages=[{"role": "user", "content": "Tell me a fun fact."}],
        max_tokens=8,
        temperature=0.8,
        seed=7,
        extra_headers={"x-hybridllm-cache": "allow"},
    )
    first = client.chat.completions.with_raw_response.create(**ask)
    again = client.chat.completions.with_raw_response.create(**ask)
    assert (first.headers["x-hybridllm-cache"], again.headers["x-hybridllm-cache"]) == (
        "miss",
        "hit",
    )
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content
