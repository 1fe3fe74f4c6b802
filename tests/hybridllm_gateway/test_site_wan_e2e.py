"""A site: a gateway beside the edge replicas, the cloud across a WAN (Toxiproxy,
hack/topology/wan.py: 60 ms round trip, 10 ms jitter, 100 Mbit/s).

Edge answers never cross the WAN; cloud answers do, and pay its round trip. When the WAN
is cut (a blackhole: connections open, nothing gets through, as when an uplink drops) the
site gateway's probes find the cloud unreachable within a few seconds: requests the edge
may serve keep being answered, requests that need the cloud get a fast 503
``tier_unreachable`` with Retry-After instead of hanging until the client gives up; when
the WAN is back, so are cloud answers.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from hybridllm_common import metrics as names

from .conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]


def _wan_module() -> Any:
    name = "hybridllm_topology_wan"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "hack" / "topology" / "wan.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _requests_of(url: str, tier: str) -> float:
    """The cloud gateway's answers so far (what crossed the WAN to it)."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(names.GATEWAY_REQUESTS_TOTAL + "{") and f'tier="{tier}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def outstanding(url: str, tier: str) -> float:
    """The site gateway's requests in flight to a tier."""
    prefix = names.GATEWAY_OUTSTANDING_REQUESTS + f'{{tier="{tier}"}} '
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.removeprefix(prefix)) for line in lines if line.startswith(prefix))


def reachable(url: str) -> list[float]:
    """The site gateway's hybridllm_gateway_tier_reachable{tier="cloud"} (empty: absent)."""
    prefix = names.GATEWAY_TIER_REACHABLE + '{tier="cloud"} '
    return [float(line.removeprefix(prefix)) for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith(prefix)]  # fmt: skip


def cloud_tokens(url: str, series: str) -> float:
    """One of the site gateway's per-tier token counters, for the cloud tier."""
    prefix = series + '{tier="cloud"} '
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.removeprefix(prefix)) for line in lines if line.startswith(prefix))


def test_a_site_answers_from_its_edge_and_fails_fast_when_the_wan_is_cut(
    procs, table, tmp_path: Path
) -> None:
    # a first token waits for the prompt at 20,000 tokens a second: a huge prompt is an
    # answer still on its way when the WAN drops
    edge, cloud, far_edge = procs.tokenservers(
        ["site-edge", "cloud-a", "far-edge"], "--rate", "500", "--prefill-rate", "20000"
    )
    # the cloud gateway serves both tiers (its own edge is another site's, far away)
    cloud_gw = procs.gateway(
        table(edge=[far_edge.url], cloud=[cloud.url]), name="cloud-routing.json"
    )
    with _wan_module().Wan(tmp_path / "toxiproxy.log") as wan:
        across = wan.link("cloud", cloud_gw.url.removeprefix("http://"))
        site_table = table(edge=[edge.url], cloud=[f"http://{across}"])
        site_table["tiers"]["cloud"]["remote"] = True
        site = procs.gateway(site_table, "--probe-interval-s", "0.5", "--probe-timeout-s", "0.5",
                             name="site-routing.json")  # fmt: skip
        short = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        # past the edge limits (2048 prompt tokens, characters / 4): the cloud's
        long = {**short, "messages": [{"role": "user", "content": "word " * 2500}]}
        with httpx.Client(timeout=30) as http:

            def ask(body: dict[str, Any], **headers: str) -> tuple[httpx.Response, float]:
                start = time.perf_counter()
                r = http.post(site.url + "/v1/chat/completions", json=body, headers=headers)
                return r, time.perf_counter() - start

            before = _requests_of(cloud_gw.url, "cloud")
            for _ in range(5):
                r, _ = ask(short)
                assert r.status_code == 200, r.text
                assert r.headers["x-hybridllm-tier"] == "edge"
            assert _requests_of(cloud_gw.url, "cloud") == before  # nothing crossed the WAN
            times = []
            for _ in range(5):
                r, took = ask(long)
                assert r.status_code == 200, r.text
                assert r.headers["x-hybridllm-tier"] == "cloud"
                times.append(took)
            assert _requests_of(cloud_gw.url, "cloud") == before + 5
            assert sorted(times)[2] >= 0.05, times  # a round trip of ~60 ms at least
            # what the site sends its cloud tier is answered by the cloud tier over there: a
            # short prompt the cloud gateway's own router would give its edge (far away)
            r, _ = ask(short, **{"x-hybridllm-tier": "cloud"})
            assert r.status_code == 200, r.text
            assert r.json()["system_fingerprint"] == "cloud-a"
            assert _requests_of(cloud_gw.url, "cloud") == before + 6
            assert ask(short)[0].json()["system_fingerprint"] == "site-edge"

            # ---- the WAN goes down with a request on its way (its first token due in ~6 s):
            # found by the probes, that request and the cloud-bound ones after it are
            # refused fast, not after the 60 s first-byte timeout
            huge = {**short, "messages": [{"role": "user", "content": "word " * 100_000}]}
            in_flight: list[tuple[httpx.Response, float]] = []
            waiter = threading.Thread(target=lambda: in_flight.append(ask(huge)), daemon=True)
            waiter.start()
            deadline = time.monotonic() + 10
            while outstanding(site.url, "cloud") != 1:
                assert time.monotonic() < deadline, "the huge request never left the site"
                time.sleep(0.05)
            cut_at = time.perf_counter()
            wan.api.cut("cloud")
            waiter.join(timeout=30)
            r, _ = in_flight[0]
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "tier_unreachable"
            assert time.perf_counter() - cut_at < 4.0  # two failed probes 0.5 s apart, and a beat
            deadline = time.monotonic() + 15
            while reachable(site.url) != [0.0]:  # a request sent now would wait out its timeout
                assert time.monotonic() < deadline, reachable(site.url)
                time.sleep(0.1)
            # the huge one was sent before the cut: the cloud gateway counted it, not stranded
            assert cloud_tokens(site.url, names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL) == 0.0
            offered = cloud_tokens(site.url, names.GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL)
            r, took = ask(long)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "tier_unreachable"
            # offered, never sent: the demand the cloud's autoscaler hears of from the site
            stranded = cloud_tokens(site.url, names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL)
            assert stranded > 2000
            assert (
                stranded
                == cloud_tokens(site.url, names.GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL) - offered
            )
            assert cloud_tokens(site.url, names.GATEWAY_STRANDED_COMPLETION_TOKENS_TOTAL) == 4.0
            assert "the cloud tier is unreachable from this gateway" in r.json()["error"]["message"]
            assert across not in r.text  # no address in the message
            assert r.headers["Retry-After"] == "5"
            assert took < 0.5, took
            for _ in range(10):  # the edge keeps answering what it may
                r, _ = ask(short)
                assert r.status_code == 200, r.text
                assert r.headers["x-hybridllm-tier"] == "edge"
            # ---- and back
            wan.api.restore("cloud")
            deadline = time.monotonic() + 15
            while reachable(site.url) != [1.0]:
                assert time.monotonic() < deadline, reachable(site.url)
                time.sleep(0.1)
            r, _ = ask(long)
            assert r.status_code == 200, r.text
            assert r.headers["x-hybridllm-tier"] == "cloud"
