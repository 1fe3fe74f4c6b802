"""Model revisions side by side in one tier: the gateway splits traffic by the revisions'
weights, keeps a session on one revision, retries a failing canary's requests on the
stable revision, and exports what the rollout analysis reads, per revision."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import metrics as names

from .conftest import MODEL


def _table(table, stable: list[str], canary: list[str], weight: int, generation: int = 1):
    routing = table(policy="edge-only", generation=generation)
    routing["tiers"] = {
        "edge": {
            "backends": [{"url": u, "revision": "v1", "weight": 100 - weight} for u in stable]
            + [{"url": u, "revision": "v2", "weight": weight} for u in canary]
        }
    }
    return routing


def _samples(url: str) -> list:
    text = httpx.get(url + "/metrics", timeout=5).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples, name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _settled(url: str, requests: int) -> list:
    """The samples once the gateway has accounted ``requests`` answers: a streamed answer
    is complete for the client when its last bytes arrive, and the gateway books it just
    after, so a scrape at once can miss the last one."""
    deadline = time.monotonic() + 30  # generous: a busy machine (two test workers) is slow
    while True:
        samples = _samples(url)
        if _value(samples, names.GATEWAY_REQUESTS_TOTAL) >= requests:
            return samples
        assert time.monotonic() < deadline, f"the gateway did not account {requests} requests"
        time.sleep(0.05)


def test_weights_split_traffic_by_revision_and_sessions_stay_on_one(procs, table) -> None:
    a1, a2, b = procs.tokenservers(["a1", "a2", "b"], "--rate", "1000")
    gw = procs.gateway(_table(table, [a1.url, a2.url], [b.url], weight=20, generation=7))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    served: Counter[str] = Counter()
    for i in range(300):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
        )
        served[str(answer.system_fingerprint)] += 1
    # 20% of 300 is 60 (binomial sd ~7): far from the 33% an even split over replicas gives
    assert 30 <= served["b"] <= 90, served
    assert min(served["a1"], served["a2"]) > 40, served
    sessions: dict[str, set[str]] = {}
    for s in range(20):
        for _ in range(4):
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_headers={"x-session-id": f"s{s}"},
            )  # fmt: skip
            sessions.setdefault(f"s{s}", set()).add(str(answer.system_fingerprint) == "b")
    assert all(len(revs) == 1 for revs in sessions.values()), sessions
    samples = _samples(gw.url)
    assert _value(samples, names.GATEWAY_REVISION_WEIGHT, tier="edge", revision="v2") == 20
    assert _value(samples, names.GATEWAY_REVISION_WEIGHT, tier="edge", revision="v1") == 80
    assert _value(samples, names.GATEWAY_REVISION_HEALTHY_BACKENDS, revision="v1") == 2
    assert _value(samples, names.GATEWAY_ROUTING_GENERATION) == 7
    ok_v2 = _value(samples, names.GATEWAY_REVISION_ATTEMPTS_TOTAL, revision="v2", result="ok")
    assert ok_v2 >= served["b"]
    ttft_v2 = _value(
        samples, names.GATEWAY_REVISION_TTFT_SECONDS + "_count", tier="edge", revision="v2"
    )
    assert ttft_v2 == ok_v2


def test_a_failing_canary_fails_no_request_and_its_errors_are_counted(procs, table) -> None:
    stable = procs.tokenserver("stable", "--rate", "1000")
    bad = procs.tokenserver("bad", "--fail-status", "500")
    gw = procs.gateway(_table(table, [stable.url], [bad.url], weight=50))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    for i in range(40):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4,
            stream=True,
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    samples = _settled(gw.url, 40)
    errors = _value(samples, names.GATEWAY_REVISION_ATTEMPTS_TOTAL, revision="v2", result="error")
    assert errors >= 1  # tried until ejected, each retried on v1
    assert _value(samples, names.GATEWAY_REVISION_ATTEMPTS_TOTAL, revision="v1", result="ok") == 40
    tpot = _value(samples, names.GATEWAY_REVISION_TPOT_SECONDS + "_count", revision="v1")
    assert tpot == 40  # streamed answers of several tokens give a time per token


def test_weight_zero_drains_a_revision_on_reload(procs, table, tmp_path) -> None:
    import json

    a, b = procs.tokenservers(["a", "b"], "--rate", "1000")
    gw = procs.gateway(_table(table, [a.url], [b.url], weight=50, generation=1))
    (tmp_path / "routing.json").write_text(
        json.dumps(_table(table, [a.url], [b.url], weight=0, generation=2))
    )
    deadline = time.monotonic() + 30
    while _value(_samples(gw.url), names.GATEWAY_ROUTING_GENERATION) != 2:
        assert time.monotonic() < deadline, "the gateway did not reload"
        time.sleep(0.1)
    before = b.stats()["requests"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    for i in range(30):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
        )
    assert b.stats()["requests"] == before


def test_the_operator_reads_a_window_per_revision_from_the_gateway(procs, table) -> None:
    """The rollout analysis's direct read (no Prometheus): the routing the gateway serves,
    then what each revision answered since the window began."""
    from hybridllm_operator.llmservice import analysis

    a, b = procs.tokenservers(["a", "b"], "--rate", "1000")
    gw = procs.gateway(_table(table, [a.url], [b.url], weight=50, generation=3))
    source = analysis.ScrapeWindows(lambda: [gw.url + "/metrics"])
    seen = source.read(None, 0.0)
    assert (seen.gateways, seen.generation) == (1, 3)
    assert seen.healthy == {("edge", "v1"): 1, ("edge", "v2"): 1}
    assert source.read(100.0, 100.0).revisions == {}  # the window begins: the baseline
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    served: Counter[str] = Counter()
    for i in range(40):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4,
            stream=True,
        )  # fmt: skip
        chunks = list(stream)  # the whole answer (a client that leaves early is not counted)
        served["v2" if any(c.system_fingerprint == "b" for c in chunks) else "v1"] += 1
    # the gateway counts an answer once its handler returns, just after the client has it
    deadline = time.monotonic() + 30
    while sum((w := source.read(100.0, 130.0)).revision("edge", v).ok for v in served) < 40:
        assert time.monotonic() < deadline, (
            f"the gateway never counted every answer: served {dict(served)}, counted "
            f"{ {k: (r.ok, r.errors) for k, r in w.revisions.items()} }"
        )
        time.sleep(0.05)
    window = w
    for revision in ("v1", "v2"):
        got = window.revision("edge", revision)
        assert (got.ok, got.errors) == (served[revision], 0)
        assert got.ttft[float("inf")] == served[revision]
        assert got.tpot[float("inf")] == served[revision]


def _golden(url: str, revision: str) -> float | None:
    found = [
        s.value
        for s in _samples(url)
        if s.name == names.GATEWAY_REVISION_GOLDEN_PASSED and s.labels.get("revision") == revision
    ]
    return min(found) if found else None


def _until(what: str, condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_golden_prompts_are_asked_of_every_canary_backend_and_never_of_clients_traffic(
    procs, table, tmp_path
) -> None:
    """The routing table's golden prompts go to each backend of the canary revision, at
    weight 0 and outside the balancer (no client request is involved, no attempt counted):
    a revision answering right passes, one more backend answering wrong fails it for the
    revision, and the stable revision is never asked."""
    import json

    stable, bad = procs.tokenservers(["stable", "bad"], "--rate", "1000")  # " tok tok ..."
    good = procs.tokenserver("good", "--token", " Paris", "--rate", "1000")
    golden = [{"prompt": "What is the capital of France?", "expect": "paris", "maxTokens": 4}]
    routing = _table(table, [stable.url], [good.url], weight=0)
    routing["goldenPrompts"] = golden
    gw = procs.gateway(routing)
    _until("the canary asked", lambda: _golden(gw.url, "v2") is not None)
    assert _golden(gw.url, "v2") == 1
    assert _golden(gw.url, "v1") is None  # the stable revision is not asked
    samples = _samples(gw.url)
    assert _value(samples, names.GATEWAY_REVISION_ATTEMPTS_TOTAL) == 0
    assert _value(samples, names.GATEWAY_REQUESTS_TOTAL) == 0

    # a second backend of v2 answers " tok ...": the revision fails the prompt
    routing = _table(table, [stable.url], [good.url, bad.url], weight=0, generation=2)
    routing["goldenPrompts"] = golden
    (tmp_path / "routing.json").write_text(json.dumps(routing))
    _until("the wrong answer seen", lambda: _golden(gw.url, "v2") == 0)
    log = (tmp_path / f"gateway-{gw.url.rsplit(':', 1)[1]}.log").read_text()
    assert f"golden prompt 1 failed on {bad.url} (edge tier, revision v2): expected /paris/" in log
    assert f"golden prompt 1 failed on {good.url}" not in log
