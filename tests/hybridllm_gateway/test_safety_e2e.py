"""Auth, rate limits and the content filter, through a gateway process."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from hybridllm_gateway import safety


def test_api_keys(procs, table, ask, tmp_path) -> None:
    edge = procs.tokenserver("edge-a")
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\nalice:{safety.hash_key('sk-alice')}\n")
    gw = procs.gateway(table(edge=[edge.url]), "--api-keys-file", str(keys))
    r = ask(gw.url, "hi")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    r = ask(gw.url, "hi", headers={"authorization": "Bearer sk-wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "invalid API key"
    assert ask(gw.url, "hi", headers={"authorization": "Bearer sk-alice"}).status_code == 200
    assert ask(gw.url, "hi", headers={"x-api-key": "sk-alice"}).status_code == 200


def test_request_and_token_rate_limits(procs, table, ask) -> None:
    edge = procs.tokenserver("edge-a")
    limits = {"requestsPerMinute": 3, "tokensPerMinute": 1_000_000}
    gw = procs.gateway(table(edge=[edge.url], rateLimits=limits), name="a.json")
    codes = [ask(gw.url, "hi").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = ask(gw.url, "hi")
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 20  # one request refills in 60/3 s

    tokens = {"requestsPerMinute": 1000, "tokensPerMinute": 100}
    gw2 = procs.gateway(table(edge=[edge.url], rateLimits=tokens), name="b.json")
    assert ask(gw2.url, "hi", max_tokens=150).status_code == 200  # 150 completion tokens charged
    r = ask(gw2.url, "hi")
    assert r.status_code == 429
    assert "tokens per minute" in r.json()["error"]["message"]


def test_tokens_are_reserved_at_admission_and_settled_on_completion(procs, table, ask) -> None:
    """The bucket is charged what a request may generate (max_tokens x best_of) when it
    is admitted, so requests in flight together cannot overspend it; the answer's end gives
    back what it did not use."""
    edge = procs.tokenserver("edge-short", "--max-tokens", "20", "--ttft-s", "1.5")
    tokens = {"requestsPerMinute": 1000, "tokensPerMinute": 1000}
    gw = procs.gateway(table(edge=[edge.url], rateLimits=tokens))
    first: dict[str, httpx.Response] = {}
    asker = threading.Thread(
        target=lambda: first.update(r=ask(gw.url, "hi", max_tokens=600, stream=True))
    )
    asker.start()
    deadline = time.monotonic() + 30
    while edge.stats()["in_flight"] < 1:  # the first holds its 600 tokens, answering
        assert time.monotonic() < deadline, edge.stats()
        time.sleep(0.05)
    r = ask(gw.url, "hi", max_tokens=600)
    assert r.status_code == 429, r.text  # 600 of 1000 reserved: no room for 600 more
    assert "tokens per minute" in r.json()["error"]["message"]
    # best_of counts: 3 candidates of 200 tokens need 600 too
    assert ask(gw.url, "hi", max_tokens=200, best_of=3).status_code == 429
    asker.join(timeout=60)
    assert first["r"].status_code == 200
    assert first["r"].text.count('"content": " tok"') == 20, first["r"].text[-500:]
    # it used 20 of its 600: the rest came back, and the same request is admitted now
    assert ask(gw.url, "hi", max_tokens=600).status_code == 200


def test_content_filter_blocks_and_redacts(procs, table, ask, tmp_path) -> None:
    echo = procs.tokenserver("edge-echo", "--echo")
    block = tmp_path / "block.json"
    block.write_text(json.dumps({"mode": "block", "deny": ["project falcon"]}))
    gw = procs.gateway(table(edge=[echo.url]), "--filter-config", str(block), name="a.json")
    r = ask(gw.url, "mail me at jane.doe@example.com")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "content_filtered"
    assert "email" in err["message"]
    assert "jane" not in err["message"]
    assert ask(gw.url, "status of Project Falcon?").status_code == 400
    assert ask(gw.url, "order 4111 1111 1111 1112 shipped").status_code == 200  # fails Luhn
    assert echo.stats()["requests"] == 1

    redact = tmp_path / "redact.json"
    redact.write_text(json.dumps({"mode": "redact"}))
    gw2 = procs.gateway(table(edge=[echo.url]), "--filter-config", str(redact), name="b.json")
    r = ask(gw2.url, "card 4111 1111 1111 1111, ssn 123-45-6789, mail a@b.io")
    assert r.status_code == 200
    upstream_saw = r.json()["choices"][0]["message"]["content"]
    assert "4111" not in upstream_saw
    assert "[REDACTED:credit_card]" in upstream_saw
    assert "[REDACTED:us_ssn]" in upstream_saw
    assert "[REDACTED:email]" in upstream_saw


def test_a_stream_whose_client_closes_on_its_last_event_is_booked(procs, table) -> None:
    """Clients close the connection once they have read ``data: [DONE]``, which can be
    before the body's end reaches the gateway (the upstream holds it back here): the
    handler is cancelled then, and the answer must still be counted and its reservation
    settled, not lost."""
    edge = procs.tokenserver("edge-held", "--hold-end-s", "5", "--rate", "1000")
    gw = procs.gateway(table(edge=[edge.url]))
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "smollm2", "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
            b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
        )
        seen = b""
        while b"data: [DONE]" not in seen:
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
    # closed before the body's end: the gateway books the answer all the same
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        booked = [line for line in text.splitlines()
                  if line.startswith("hybridllm_gateway_requests_total{") and 'code="200"' in line]  # fmt: skip
        if booked and booked[0].endswith(" 1.0"):
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.1)
    assert edge.stats()["in_flight"] <= 1  # the upstream was let go or is ending
