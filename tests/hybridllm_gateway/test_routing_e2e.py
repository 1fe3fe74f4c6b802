"""The gateway process in front of real token-server processes: the OpenAI client through
it, tier routing rules, affinity, spill, cascade, streaming cancellation."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
import pytest

from hybridllm_common import metrics as names

MODEL = "smollm2"


def test_openai_client_streams_and_completes_through_the_gateway(procs, table) -> None:
    edge, cloud = procs.tokenservers(["edge-a", "cloud-a"])
    gw = procs.gateway(table(edge=[edge.url], cloud=[cloud.url]))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)

    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.choices[0].message.content == " tok tok tok"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 3

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == " tok" * 5

    legacy = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
    assert legacy.choices[0].text == " tok" * 4
    streamed = client.completions.create(model=MODEL, prompt="Once", max_tokens=2, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == " tok" * 2
    # a streamed answer counts its tokens, not its finish chunk nor [DONE]
    served = httpx.get(gw.url + "/metrics").text
    counted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in served.splitlines()
        if line.startswith(names.GATEWAY_COMPLETION_TOKENS_TOTAL + "{")
    )
    assert counted == 3 + 5 + 4 + 2
    assert sorted(m.id for m in client.models.list()) == [MODEL, f"{MODEL}:cloud", f"{MODEL}:edge"]

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_routing_rules(procs, table, ask) -> None:
    edge, cloud = procs.tokenservers(["edge-a", "cloud-a"])
    gw = procs.gateway(table(edge=[edge.url], cloud=[cloud.url]))

    def served(r: httpx.Response) -> tuple[str, str, str]:
        assert r.status_code == 200, r.text
        return (
            r.json()["system_fingerprint"],
            r.headers["x-hybridllm-tier"],
            r.headers["x-hybridllm-route"],
        )

    assert served(ask(gw.url, "Hi, how are you?")) == ("edge-a", "edge", "classifier")
    # an explicit choice wins over the classifier, by header or by model suffix
    assert served(ask(gw.url, "Hi", headers={"x-hybridllm-tier": "cloud"})) == (
        "cloud-a",
        "cloud",
        "explicit",
    )
    assert served(ask(gw.url, "Write a 3000-word essay", model=f"{MODEL}:edge")) == (
        "edge-a",
        "edge",
        "explicit",
    )
    # beyond the edge limits -> cloud
    assert served(ask(gw.url, "Hi", max_tokens=1000))[1:] == ("cloud", "edge_limits")
    assert served(ask(gw.url, "x " * 5000))[1:] == ("cloud", "edge_limits")
    # a request with tools is routed like any other (both tiers serve tools); the
    # classifier sends code-and-reasoning work to the cloud
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert served(ask(gw.url, "What's the weather?", tools=tools))[1:] == ("edge", "classifier")
    hard = "Find the bug and fix it step by step:\n```\ndef f(x):\n    return x[0]\n```"
    assert served(ask(gw.url, hard, max_tokens=400))[1:] == ("cloud", "classifier")
    # an unknown tier is a clear 400
    r = ask(gw.url, "hi", headers={"x-hybridllm-tier": "moon"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_parameter"

    metrics = httpx.get(gw.url + "/metrics").text
    assert 'hybridllm_gateway_request_kinds_total{kind="tools",tier="edge"} 1.0' in metrics
    assert 'hybridllm_gateway_route_decisions_total{reason="explicit",tier="cloud"} 1.0' in metrics
    assert (
        'hybridllm_gateway_route_decisions_total{reason="edge_limits",tier="cloud"} 2.0' in metrics
    )


def test_policies_and_single_tier(procs, table, ask) -> None:
    edge, cloud = procs.tokenservers(["edge-a", "cloud-a"])
    gw = procs.gateway(
        table(edge=[edge.url], cloud=[cloud.url], policy="cloud-only"), name="a.json"
    )
    assert ask(gw.url, "hi").json()["system_fingerprint"] == "cloud-a"
    gw2 = procs.gateway(table(cloud=[cloud.url]), name="b.json")
    r = ask(gw2.url, "hi")
    assert r.json()["system_fingerprint"] == "cloud-a"
    assert r.headers["x-hybridllm-route"] == "single_tier"


def test_session_affinity_is_stable_and_sessions_spread(procs, table, ask) -> None:
    edges = procs.tokenservers([f"edge-{i}" for i in range(3)])
    gw = procs.gateway(table(edge=[e.url for e in edges]))
    for session in ("alice", "bob", "carol"):
        seen = {ask(gw.url, "hi", headers={"x-session-id": session}).json()["system_fingerprint"]
                for _ in range(8)}  # fmt: skip
        assert len(seen) == 1, (session, seen)
    # the `user` field is a session too
    seen = {ask(gw.url, "hi", user="dave").json()["system_fingerprint"] for _ in range(5)}
    assert len(seen) == 1
    owners = Counter(
        ask(gw.url, "hi", headers={"x-session-id": f"s{i}"}).json()["system_fingerprint"]
        for i in range(60)
    )
    assert len(owners) == 3, owners  # 60 sessions land on all three replicas


def test_prefix_affinity_without_session(procs, table, ask) -> None:
    edges = procs.tokenservers([f"edge-{i}" for i in range(3)])
    gw = procs.gateway(table(edge=[e.url for e in edges]))
    system = "You are the support bot of ACME. " * 4
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    seen = {ask(gw.url, **body).json()["system_fingerprint"] for _ in range(6)}
    assert len(seen) == 1


def test_edge_overload_spills_to_cloud(procs, table, ask) -> None:
    edge = procs.tokenserver("edge-a", "--rate", "5")
    cloud = procs.tokenserver("cloud-a")
    limits = {"maxPromptTokens": 2048, "maxOutputTokens": 512, "maxQueueDepth": 0}
    gw = procs.gateway(table(edge=[edge.url], cloud=[cloud.url], edgeLimits=limits))
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 50,
        "stream": True,
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=payload, timeout=30) as held:
        assert held.headers["x-hybridllm-tier"] == "edge"
        chunks = held.iter_bytes()  # keep the iterator: dropping it closes the stream
        next(chunks)  # the edge replica now has one request outstanding
        r = ask(gw.url, "hi")
        assert r.headers["x-hybridllm-tier"] == "cloud"
        assert r.headers["x-hybridllm-route"] == "spill_overload"
    edge.kill()
    r = ask(gw.url, "hi")
    assert r.status_code == 200
    assert r.headers["x-hybridllm-tier"] == "cloud"


HARD = "Find the bug and fix it step by step:\n```\ndef f(x):\n    return x[0]\n```"


def held(url: str, **headers: str):
    """A streamed request kept open: its replica has one request outstanding until closed."""
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 50, "stream": True}  # fmt: skip
    return httpx.stream("POST", url + "/v1/chat/completions", json=payload, headers=headers,
                        timeout=30)  # fmt: skip


def test_balance_moves_requests_off_the_busier_tier(procs, table, ask) -> None:
    # 30 tokens at most, 10 a second: a held stream stays outstanding for 3 s
    edge = procs.tokenserver("edge-a", "--rate", "10", "--max-tokens", "30")
    cloud = procs.tokenserver("cloud-a", "--rate", "10", "--max-tokens", "30")
    tiers = {"edge": [edge.url], "cloud": [cloud.url]}
    off = procs.gateway(table(**tiers), name="off.json")
    on = procs.gateway(table(**tiers, balance={"enabled": True, "margin": 0}), name="on.json")
    wide = procs.gateway(table(**tiers, balance={"enabled": True, "margin": 1}), name="wide.json")

    def route(url: str, content: str = "hi", **body) -> tuple[str, str]:
        r = ask(url, content, **body)
        assert r.status_code == 200, r.text
        return r.headers["x-hybridllm-tier"], r.headers["x-hybridllm-route"]

    # idle tiers: the classifier decides, balance or not
    assert route(on.url) == ("edge", "classifier")
    assert route(on.url, HARD, max_tokens=400) == ("cloud", "classifier")
    # the edge busy (one outstanding), the cloud idle. off: the classifier's choice stands;
    # margin 0: busier by 1 moves it; margin 1: it does not
    expected = [("edge", "classifier"), ("cloud", "balance"), ("edge", "classifier")]
    for gw, want in zip((off, on, wide), expected, strict=True):
        with held(gw.url) as stream:
            assert stream.headers["x-hybridllm-tier"] == "edge"
            chunks = stream.iter_bytes()
            next(chunks)
            assert route(gw.url) == want
    # the other way: the cloud busy, a request the classifier sends there goes to the edge
    with held(on.url, **{"x-hybridllm-tier": "cloud"}) as stream:
        chunks = stream.iter_bytes()
        next(chunks)
        assert route(on.url, HARD, max_tokens=400) == ("edge", "balance")
        # hard limits stand: tools and requests beyond the edge limits never move to the edge
        assert route(on.url, "x " * 5000) == ("cloud", "edge_limits")
    full = procs.gateway(table(**tiers, balance={"enabled": True, "margin": 0},
                               edgeLimits={"maxPromptTokens": 2048, "maxOutputTokens": 512,
                                           "maxQueueDepth": 0}), name="full.json")  # fmt: skip
    with held(full.url, **{"x-hybridllm-tier": "cloud"}) as a, held(full.url, **{"x-hybridllm-tier": "cloud"}) as b:  # fmt: skip
        next(a.iter_bytes())
        next(b.iter_bytes())
        with held(full.url, **{"x-hybridllm-tier": "edge"}) as c:
            next(c.iter_bytes())
            # the cloud busier by 1, but the edge is past maxQueueDepth 0: no move into it
            assert route(full.url, HARD, max_tokens=400) == ("cloud", "classifier")
    metrics = httpx.get(on.url + "/metrics").text
    assert 'hybridllm_gateway_route_decisions_total{reason="balance",tier="cloud"} 1.0' in metrics
    assert 'hybridllm_gateway_route_decisions_total{reason="balance",tier="edge"} 1.0' in metrics


def test_cascade_reasks_the_cloud_when_the_edge_is_unsure(procs, table, ask) -> None:
    unsure = procs.tokenserver("edge-unsure", "--mean-logprob", "-3.0")
    cloud = procs.tokenserver("cloud-a")
    cascade = {"enabled": True, "minMeanLogprob": -1.5}
    gw = procs.gateway(table(edge=[unsure.url], cloud=[cloud.url], cascade=cascade), name="a.json")
    r = ask(gw.url, "hi")
    assert r.json()["system_fingerprint"] == "cloud-a"
    assert r.headers["x-hybridllm-route"] == "cascade"
    assert unsure.stats()["requests"] == 1

    sure = procs.tokenserver("edge-sure", "--mean-logprob", "-0.2")
    gw2 = procs.gateway(table(edge=[sure.url], cloud=[cloud.url], cascade=cascade), name="b.json")
    r = ask(gw2.url, "hi")
    assert r.json()["system_fingerprint"] == "edge-sure"
    assert r.json()["choices"][0]["logprobs"] is None  # the client did not ask for them
    r = ask(gw2.url, "hi", logprobs=True)
    assert len(r.json()["choices"][0]["logprobs"]["content"]) == 2


def test_client_disconnect_cancels_the_upstream_stream(procs, table) -> None:
    edge = procs.tokenserver("edge-a", "--rate", "20")
    gw = procs.gateway(table(edge=[edge.url]))
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2000,
        "stream": True,
    }
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=payload, timeout=30) as r:
        first = next(r.iter_bytes())
        assert first.startswith(b"data: ")
    deadline = 200  # polls of /stats, each a real round trip; no fixed sleep
    for _ in range(deadline):
        stats = edge.stats()
        if stats["cancelled"] == 1:
            break
        httpx.get(gw.url + "/health")
    assert stats["cancelled"] == 1
    assert stats["in_flight"] == 0
    assert stats["completed"] == 0


def test_errors_keep_the_runtime_shape(procs, table) -> None:
    edge = procs.tokenserver("edge-a")
    gw = procs.gateway(table(edge=[edge.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 7},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "top_p"
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(
        gw.url + "/v1/completions", content=json.dumps({"prompt": "x" * (2 << 20)}), timeout=10
    )
    assert r.status_code == 400
    assert "bytes" in r.json()["error"]["message"]
