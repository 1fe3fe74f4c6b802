"""The gateway's demand series and the operator's direct reader of them (`GatewayScrape`),
on real gateway processes in front of token servers. Read times are passed in, so rates
are exact: tokens counted between two reads over the seconds between them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_common import metrics as names
from hybridllm_operator.llmservice import demand


def _tokens(gw_url: str) -> demand._Sample:
    return demand.parse_gateway_metrics(demand._http_get(gw_url + "/metrics"), 0.0)


def test_demand_series_exist_at_zero_and_count_what_each_tier_answered(procs, table, ask):
    edge, cloud = procs.tokenservers(["edge-a", "cloud-a"])
    gw = procs.gateway(table(edge=[edge.url], cloud=[cloud.url]))
    before = _tokens(gw.url)
    # no request yet: the series exist, at zero (zero load, not a missing metric)
    assert before.prompt == {"edge": 0.0, "cloud": 0.0}
    assert before.completion == {"edge": 0.0, "cloud": 0.0}

    scrape = demand.GatewayScrape(lambda: [gw.url + "/metrics"], bin_s=10.0)
    first = scrape.read(1000.0)
    assert first.tiers == {}
    assert "a rate needs two" in first.problems["edge"]
    idle = scrape.read(1010.0)
    assert idle.problems == {}
    assert idle.tiers["edge"].prompt_tok_s == 0.0
    assert idle.tiers["cloud"].completion_tok_s == 0.0

    content = "x" * 40  # 40 characters: 10 prompt tokens by the gateway's estimate
    for _ in range(6):
        assert ask(gw.url, content, headers={"x-hybridllm-tier": "edge"}, max_tokens=5).is_success
    for _ in range(2):
        assert ask(gw.url, content, headers={"x-hybridllm-tier": "cloud"}, max_tokens=7).is_success
    bad = ask(gw.url, content, headers={"x-hybridllm-tier": "moon"})
    assert bad.status_code == 400  # refused: no tier's work
    after = _tokens(gw.url)
    assert after.completion == {"edge": 30.0, "cloud": 14.0}
    assert after.prompt["edge"] == 6 * after.prompt["cloud"] / 2 > 0

    busy = scrape.read(1020.0)
    assert busy.tiers["edge"].completion_tok_s == pytest.approx(3.0)  # 30 tokens in 10 s
    assert busy.tiers["cloud"].completion_tok_s == pytest.approx(1.4)
    assert busy.tiers["edge"].prompt_tok_s == pytest.approx(after.prompt["edge"] / 10)
    assert busy.tiers["edge"].ttft_p95_s is not None
    # the history: bins [1000, 1010) idle, [1010, 1020) busy; the bin of 1020 is not complete
    bins, start = busy.bins["edge"], busy.bins_start_s
    assert start == 1000.0
    assert bins == [(0.0, 0.0), (pytest.approx(after.prompt["edge"] / 10), pytest.approx(3.0))]


def _answered(gw_url: str) -> dict[str, float]:
    """Completion tokens answered, by tier (the served counter, not the offered one)."""
    text = demand._http_get(gw_url + "/metrics")
    return {
        s.labels["tier"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == names.GATEWAY_COMPLETION_TOKENS_TOTAL
    }


def _until(what: str, ok, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_offered_demand_counts_requests_on_arrival_not_on_answer(procs, table, ask):
    """A queued request, or one its tier never answers, is offered load all the same; its
    completion tokens are the tier's mean answer, capped by its max_tokens."""
    edge = procs.tokenserver("edge-a", "--max-concurrency", "2", "--rate", "5")
    gw = procs.gateway(table(edge=[edge.url]))
    content = "x" * 40  # 10 prompt tokens by the gateway's estimate
    long = {"headers": {"x-hybridllm-tier": "edge"}, "max_tokens": 500}  # 100 s to answer
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(ask, gw.url, content, **long)
        _until("the first request upstream", lambda: edge.stats()["requests"] == 1)
        offered = _tokens(gw.url)
        assert offered.prompt["edge"] == 10.0  # counted on arrival
        assert offered.completion["edge"] == 0.0  # no answer yet: no mean to estimate by

        # an answer of 3 tokens gives the mean: both requests so far are counted by it
        assert ask(gw.url, content, headers={"x-hybridllm-tier": "edge"}, max_tokens=3).is_success
        assert _tokens(gw.url).completion["edge"] == 6.0
        assert _answered(gw.url)["edge"] == 3.0

        # two more long ones (one queued behind the full slots) and one capped at 1 token
        rest = [pool.submit(ask, gw.url, content, **long) for _ in range(2)]
        _until("one request queued", lambda: edge.stats()["waiting"] == 1)
        rest.append(pool.submit(ask, gw.url, content, headers=long["headers"], max_tokens=1))
        _until("two requests queued", lambda: edge.stats()["waiting"] == 2)
        offered = _tokens(gw.url)
        assert offered.prompt["edge"] == 50.0
        assert offered.completion["edge"] == 6.0 + 3.0 + 3.0 + 1.0
        assert _answered(gw.url)["edge"] == 3.0  # the pool answered none of them yet

        edge.kill()  # the tier fails them: they stay offered demand, and no answer counts
        assert all(f.result().status_code >= 500 for f in [first, *rest])
    assert _tokens(gw.url).completion["edge"] == 13.0
    assert _answered(gw.url)["edge"] == 3.0


def test_a_gateway_that_does_not_answer_holds_the_tier_and_a_restart_is_not_a_drop(
    procs, table, ask
):
    edge = procs.tokenserver("edge-a")
    gws = [procs.gateway(table(edge=[edge.url]), name=f"r{i}.json") for i in range(2)]
    urls = [g.url + "/metrics" for g in gws]
    scrape = demand.GatewayScrape(lambda: urls, bin_s=60.0)
    scrape.read(0.0)
    for gw in gws:
        assert ask(gw.url, "hello", max_tokens=4).is_success
    both = scrape.read(10.0)
    assert both.tiers["edge"].completion_tok_s == pytest.approx(0.8)  # 2 x 4 tokens in 10 s

    gws[1].kill()  # one replica gone: a sum without it would look like a fall in demand
    held = scrape.read(20.0)
    assert "edge" not in held.tiers
    assert "could not be read" in held.problems["edge"]
    assert urls[1] in held.problems["edge"]

    # the dead replica leaves the list of Ready gateways; a new one (a restart) appears:
    # its first sample is not a rate yet, then its counters count from zero again
    urls[1] = procs.gateway(table(edge=[edge.url]), name="r2.json").url + "/metrics"
    assert "a rate needs two" in scrape.read(30.0).problems["edge"]
    assert ask(urls[1].removesuffix("/metrics"), "hello", max_tokens=4).is_success
    again = scrape.read(40.0)
    assert again.tiers["edge"].completion_tok_s == pytest.approx(0.4)


def test_no_gateway_means_no_reading():
    snap = demand.GatewayScrape(lambda: []).read(0.0)
    assert snap.tiers == {}
    assert snap.problems["edge"] == "no Ready gateway replica to read demand from"


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 10.0, 0.5: 60.0, 1.0: 90.0, float("inf"): 100.0}
    assert demand.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert demand.histogram_quantile(0.95, buckets) == 1.0  # in +Inf: the largest bound
    assert demand.histogram_quantile(0.05, buckets) == pytest.approx(0.05)
    assert demand.histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_scrapes_keep_one_connection_per_gateway_and_a_refusal_is_an_error(procs, table):
    edge = procs.tokenserver("edge-a")
    gw = procs.gateway(table(edge=[edge.url]))
    url = gw.url + "/metrics"
    pool = demand._scrapes.connection_from_url(url)
    made = pool.num_connections
    for _ in range(3):
        assert demand.parse_gateway_metrics(demand.scrape(url), 0.0).prompt["edge"] == 0.0
    assert pool.num_connections - made <= 1  # three reads, one connection (at most: new)
    with pytest.raises(OSError, match="HTTP 404"):
        demand.scrape(gw.url + "/no-such-page")
    gw.kill()
    with pytest.raises(OSError, match="refused"):  # the kept connection is gone; no new one
        demand.scrape(url)


def test_offered_and_stranded_completion_estimates_are_the_recent_mean_capped_by_max_tokens_times_n():
    from prometheus_client import CollectorRegistry, Counter

    from hybridllm_gateway.metrics import OfferedDemand, completion_cap

    r = CollectorRegistry()
    offered = OfferedDemand(
        *(Counter(n, n, ["tier"], registry=r) for n in ("p", "c", "sp", "sc")), window=4
    )

    def completion(name: str = "c") -> float:
        return r.get_sample_value(f"{name}_total", {"tier": "cloud"}) or 0.0

    offered.offer("cloud", 5, None)
    offered.offer("cloud", 5, 2)
    offered.offer("cloud", 3, None)  # then refused: the cloud unreachable from here
    offered.strand("cloud", 3, None)
    assert completion() == completion("sc") == 0.0  # no answer yet: held until one gives the mean
    offered.answered("cloud", 10)
    assert completion() == 10.0 + 2.0 + 10.0  # mean 10; the second capped at 2
    assert completion("sc") == 10.0  # the stranded one: counted again, as stranded
    assert r.get_sample_value("sp_total", {"tier": "cloud"}) == 3.0
    offered.strand("cloud", 4, 1)
    assert completion("sc") == 11.0
    for tokens in (20, 20, 20, 20):  # the window keeps the last four: the 10 drops out
        offered.answered("cloud", tokens)
    offered.offer("cloud", 5, None)
    assert completion() == 22.0 + 20.0
    offered.answered("edge", 7)  # another tier's answers are not this tier's mean
    offered.offer("cloud", 5, 64)
    assert completion() == 62.0
    assert r.get_sample_value("p_total", {"tier": "cloud"}) == 23.0

    assert completion_cap({"max_tokens": 8, "n": 3}) == 24
    assert completion_cap({"max_completion_tokens": 8, "max_tokens": 100}) == 8
    assert completion_cap({"n": 3}) is None
    assert completion_cap({"max_tokens": True}) is None


def test_the_history_starts_where_the_tiers_bins_start_and_a_late_tier_is_padded():
    """One start for every tier's bins: an edge-only service's history starts at its first
    read (not at 0 s, where a forecast would reach nothing); a tier first exported later
    is zero before it."""
    pages = {"edge": 'hybridllm_gateway_offered_prompt_tokens_total{tier="edge"} %s\n'}
    clock = [0.0]

    def page(_: str) -> str:
        text = pages["edge"] % (100.0 * clock[0])
        if clock[0] >= 1020.0:  # the cloud tier appears (enabled in the spec)
            text += 'hybridllm_gateway_offered_prompt_tokens_total{tier="cloud"} %s\n' % (
                10.0 * (clock[0] - 1020.0)
            )
        return text

    scrape = demand.GatewayScrape(lambda: ["gw"], bin_s=10.0, fetch=page)
    for clock[0] in (1000.0, 1010.0, 1020.0):
        snap = scrape.read(clock[0])
    assert snap.bins_start_s == 1000.0
    assert snap.bins["edge"] == [(100.0, 0.0), (100.0, 0.0)]
    assert snap.bins["cloud"] == []
    for clock[0] in (1030.0, 1040.0):
        snap = scrape.read(clock[0])
    assert snap.bins_start_s == 1000.0
    assert len(snap.bins["edge"]) == len(snap.bins["cloud"]) == 4
    assert snap.bins["cloud"] == [(0.0, 0.0), (0.0, 0.0), (10.0, 0.0), (10.0, 0.0)]


def test_answers_of_503_and_first_byte_timeouts_in_the_window_are_read_per_tier():
    """The autoscaler's saturation signals: 503s the gateways answered for a tier, and its
    attempts that timed out before a first byte, since the last read (other codes, kinds
    and tiers apart; a gateway restart is not a drop)."""
    counts = {"edge": 0.0, "cloud": 0.0}

    def page(_: str) -> str:
        return "".join(
            f'hybridllm_gateway_offered_prompt_tokens_total{{tier="{t}"}} 0\n'
            f'hybridllm_gateway_requests_total{{tier="{t}",code="503"}} {n}\n'
            f'hybridllm_gateway_requests_total{{tier="{t}",code="200"}} 99\n'
            f'hybridllm_gateway_upstream_errors_total{{tier="{t}",kind="timeout"}} {n / 2}\n'
            f'hybridllm_gateway_upstream_errors_total{{tier="{t}",kind="connect"}} 77\n'
            for t, n in counts.items()
        )

    scrape = demand.GatewayScrape(lambda: ["gw"], bin_s=10.0, fetch=page)
    scrape.read(0.0)
    counts["cloud"] = 34.0
    snap = scrape.read(15.0)
    assert (snap.tiers["cloud"].overloaded, snap.tiers["edge"].overloaded) == (34.0, 0.0)
    assert (snap.tiers["cloud"].timed_out, snap.tiers["edge"].timed_out) == (17.0, 0.0)
    counts["cloud"] = 4.0  # the gateway restarted: its counters began again
    again = scrape.read(30.0).tiers["cloud"]
    assert (again.overloaded, again.timed_out) == (4.0, 2.0)
