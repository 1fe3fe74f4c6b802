"""The raw streaming relay: chunk framing, non-chunked upstreams, errors, backpressure.

The framing scanner is fed every split of a real chunked body. The relay runs in
process: the gateway app on an aiohttp runner and hand-written upstream servers on raw
sockets, so each test controls the exact bytes and timing the upstream sends.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from hybridllm_gateway import app as app_mod
from hybridllm_gateway import config, relay

EVENTS = [f"data: {json.dumps({'n': i, 'text': 'tok' * i})}\n\n".encode() for i in range(5)]
EVENTS.append(b"data: [DONE]\n\n")


def chunked(parts: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailers + b"\r\n"


def framed_body(parts: list[bytes]) -> bytes:
    """What the relay passes on: the chunked body without its terminator."""
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)


def test_whole_chunks_pass_through_unchanged_and_the_terminator_is_held_back() -> None:
    sc = relay.ChunkScanner()
    one = b"%x\r\n%b\r\n" % (len(EVENTS[0]), EVENTS[0])
    assert sc.feed(one) is one  # the common case: no copy
    assert sc.feed(b"0\r\n\r\n") == b""
    assert sc.done


@pytest.mark.parametrize("trailers", [b"", b"x-usage: 12\r\n"])
def test_every_split_of_a_body_relays_the_same_bytes(trailers: bytes) -> None:
    body = chunked(EVENTS, trailers)
    want = framed_body(EVENTS)
    for cut in range(len(body) + 1):
        sc = relay.ChunkScanner()
        got = sc.feed(body[:cut]) + sc.feed(body[cut:])
        assert got == want, cut
        assert sc.done, cut
    sc = relay.ChunkScanner(keep=True)
    got = b"".join(sc.feed(body[i : i + 1]) for i in range(len(body)))
    assert got == want
    assert sc.done
    assert b"".join(sc.payload) == b"".join(EVENTS)


@pytest.mark.parametrize(
    "line",
    # -6 stepped the scanner backwards forever (int() takes a sign, 0x and underscores)
    [b"zz", b"-6", b"+6", b"0x6", b"1_0", b" ", b"1" * 17, b";ext=1", "\u0661".encode()],
)
def test_bad_chunk_size_is_an_upstream_error(line: bytes) -> None:
    with pytest.raises(relay.UpstreamError, match="bad chunk size"):
        relay.ChunkScanner().feed(line + b"\r\nhello\r\n")
    assert relay.chunk_size(b"1A;name=v ") == 26


@pytest.mark.parametrize("value", [b"-5", b"+5", b"5_0", b"0x5", b"9" * 19])
def test_a_bad_content_length_is_an_upstream_error(value: bytes) -> None:
    with pytest.raises(relay.UpstreamError, match="bad content-length"):
        relay.parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: " + value)


def test_parse_head() -> None:
    head = relay.parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b")
    assert (head.status, head.chunked, head.keep_alive, head.headers["x-a"]) == (
        200,
        True,
        True,
        "b",
    )
    head = relay.parse_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 7\r\nConnection: close")
    assert (head.status, head.length, head.keep_alive) == (404, 7, False)
    with pytest.raises(relay.UpstreamError):
        relay.parse_head(b"SSH-2.0-OpenSSH")


# --------------------------------------------------------------------------- in process

Upstream = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length)


async def start_gateway(
    tmp_path: Path, upstream_port: int, stream_relay: str = "raw", both_tiers: bool = False
) -> tuple[web.AppRunner, str]:
    backends = [{"url": f"http://127.0.0.1:{upstream_port}"}]
    routing = {
        "model": "smollm2",
        "policy": "auto" if both_tiers else "cloud-only",
        "rateLimits": {"requestsPerMinute": 10**6, "tokensPerMinute": 10**9},
        "tiers": {"cloud": {"backends": backends}}
        | ({"edge": {"backends": backends}} if both_tiers else {}),
    }
    (tmp_path / "routing.json").write_text(json.dumps(routing))
    settings = config.GatewaySettings(
        config=tmp_path / "routing.json", first_byte_timeout_s=10, stream_relay=stream_relay
    )
    runner = web.AppRunner(app_mod.create_app(settings), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def served(
    tmp_path: Path,
    upstream: Upstream,
    client: Callable[[str], Awaitable[None]],
    stream_relay: str = "raw",
    both_tiers: bool = False,
) -> None:
    """Runs ``client(gateway_url)`` against a gateway in front of ``upstream``, then stops
    both; ``both_tiers``: the upstream is the edge tier's backend too."""

    async def main() -> None:
        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        runner, url = await start_gateway(tmp_path, port, stream_relay, both_tiers)
        try:
            await asyncio.wait_for(client(url), timeout=60)
        finally:
            await runner.cleanup()
            server.close()

    asyncio.run(main())


def request_bytes(url: str, stream: bool = True) -> bytes:
    body = json.dumps({
        "model": "smollm2", "stream": stream, "messages": [{"role": "user", "content": "hi"}]
    }).encode()  # fmt: skip
    host = url.removeprefix("http://")
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def exchange(url: str, stream: bool = True) -> tuple[bytes, bytes]:
    """One request on a raw socket; (response head, de-chunked body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request_bytes(url, stream))
    head = await reader.readuntil(b"\r\n\r\n")
    sc = relay.ChunkScanner(keep=True)
    if b"chunked" in head.lower():
        while not sc.done:
            data = await reader.read(65536)
            assert data, "connection closed before the end of the body"
            sc.feed(data)
        body = b"".join(sc.payload)
    else:
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
    writer.close()
    return head, body


def test_content_length_upstream_is_reframed_for_the_client(tmp_path: Path) -> None:
    stream = b"".join(EVENTS)

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(stream))  # fmt: skip
        for i in range(0, len(stream), 7):  # small writes: many reads on the relay side
            writer.write(stream[i : i + 7])
            await writer.drain()
        writer.close()

    async def client(url: str) -> None:
        head, body = await exchange(url)
        assert head.startswith(b"HTTP/1.1 200")
        assert body == stream

    served(tmp_path, upstream, client)


@pytest.mark.parametrize("stream_relay", ["raw", "aiohttp"])
def test_chunked_upstream_with_split_frames_arrives_whole(
    tmp_path: Path, stream_relay: str
) -> None:
    wire = chunked(EVENTS, b"x-trailer: 1\r\n")

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(wire), 3):
            writer.write(wire[i : i + 3])
            await writer.drain()
        await reader.read()  # keep-alive: the gateway may keep the connection

    async def client(url: str) -> None:
        _, body = await exchange(url)
        assert body == b"".join(EVENTS)

    served(tmp_path, upstream, client, stream_relay)


def test_close_delimited_upstream_ends_the_stream_at_close(tmp_path: Path) -> None:
    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        for event in EVENTS:
            writer.write(event)
            await writer.drain()
        writer.close()

    async def client(url: str) -> None:
        _, body = await exchange(url)
        assert body == b"".join(EVENTS)

    served(tmp_path, upstream, client)


def test_a_4xx_chunked_answer_is_passed_through_decoded(tmp_path: Path) -> None:
    error = json.dumps({"error": {"message": "too long", "type": "invalid_request_error",
                                  "param": None, "code": "context_length_exceeded"}}).encode()  # fmt: skip

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + chunked([error[:10], error[10:]]))  # fmt: skip
        await reader.read()

    async def client(url: str) -> None:
        head, body = await exchange(url)
        assert head.startswith(b"HTTP/1.1 400")
        assert json.loads(body)["error"]["code"] == "context_length_exceeded"

    served(tmp_path, upstream, client)


def test_a_client_that_stops_reading_pauses_the_upstream(tmp_path: Path) -> None:
    """Backpressure: the upstream can only write what the socket buffers on the way hold."""
    piece = b"data: " + b"x" * 65530 + b"\n\n"
    total_pieces = 1024  # 64 MiB: far more than the kernel buffers between the two ends
    written = 0
    finished = False

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written, finished
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(total_pieces):
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            await writer.drain()
            written += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        finished = True
        await reader.read()

    async def client(url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.connect((host, int(port)))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(request_bytes(url))
        await reader.readuntil(b"\r\n\r\n")
        # not reading: the upstream must stall well short of the whole stream
        last, still = -1, 0
        for _ in range(400):  # each poll yields to the loop; stable for 20 polls = stalled
            await asyncio.sleep(0.01)
            still = still + 1 if written == last else 0
            last = written
            if still >= 20:
                break
        assert still >= 20, f"upstream never stalled ({written} of {total_pieces} pieces written)"
        assert written < total_pieces // 2
        # reading again resumes the upstream, and every byte arrives
        sc = relay.ChunkScanner()
        received = 0
        while not sc.done:
            data = await reader.read(1 << 20)
            assert data
            received += len(sc.feed(data))
        assert finished
        assert received == total_pieces * len(b"%x\r\n%b\r\n" % (len(piece), piece))
        writer.close()

    served(tmp_path, upstream, client)


def test_a_pooled_connection_closed_while_idle_is_retried_without_blame(tmp_path: Path) -> None:
    """The upstream drops a kept-alive connection as the next request arrives on it."""
    wire = chunked(EVENTS)
    connections = 0

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + wire)
        await writer.drain()
        await read_request(reader)  # a second request on this connection: hang up on it
        writer.close()

    async def client(url: str) -> None:
        for _ in range(2):
            head, body = await exchange(url)
            assert head.startswith(b"HTTP/1.1 200")
            assert body == b"".join(EVENTS)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        metrics = (await reader.read()).decode()
        writer.close()
        assert connections == 2  # the second request went out again on a fresh connection
        assert "hybridllm_gateway_upstream_errors_total{" not in metrics
        assert 'hybridllm_gateway_requests_total{code="200",tier="cloud"} 2.0' in metrics

    served(tmp_path, upstream, client)


# --------------------------------------------------------------------------- hostile upstream

HOSTILE = {
    # name: (what the upstream sends after reading the request, what the client's 502 says)
    "negative-size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\nX", "bad chunk size"),
    "huge-size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 20 + b"\r\nX", "bad chunk size"),
    "non-hex-size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nX", "bad chunk size"),
    "endless-head": (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 100_000, "head over 64 KiB"),
    "error-past-cap": (b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n"
                       + b"10000\r\n" + b"e" * 0x10000 + b"\r\n", "answer is over"),
    "slow-drip": (b"HTTP/1.1 2", "no answer within"),
}  # fmt: skip
BIG = 64 << 20  # what the past-cap upstreams offer: 64x the gateway's cap


def test_hostile_upstreams_get_a_502_naming_their_fault_and_hurt_no_other_stream(
    tmp_path: Path,
) -> None:
    """One gateway, two backends: the edge one answers well-behaved streams, the cloud one
    is hostile (a negative, over-long or non-hex chunk size, a head that never ends, an
    error body and a whole answer far past the gateway's cap, a head that stalls, a reset
    inside a chunk). Every hostile request ends in a 502 naming the upstream's fault and
    no address; the loop never stalls (the well-behaved streams running beside them all
    finish with the same bytes); the gateway reads at most about its cap of each oversized
    answer before cutting it."""
    good_body = chunked(EVENTS)
    offered: dict[str, int] = {}

    async def good(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (good_body[i : i + 7] for i in range(0, len(good_body), 7)):
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0)

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = json.loads(await read_request(reader))
        case = body["messages"][0]["content"]
        try:
            if case in HOSTILE:
                writer.write(HOSTILE[case][0])
                await writer.drain()
                if case.endswith("past-cap"):  # more of the same, until the gateway cuts it
                    for sent in range(0, BIG, 0x10000):
                        writer.write(b"10000\r\n" + b"e" * 0x10000 + b"\r\n")
                        await writer.drain()
                        offered[case] = sent
                await asyncio.sleep(30)  # the rest never comes (the drip stalls here)
            elif case == "whole-past-cap":  # a non-streamed answer far past the cap
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % BIG)
                for sent in range(0, BIG, 0x10000):
                    writer.write(b"{" * 0x10000)
                    await writer.drain()
                    offered[case] = sent
            elif case == "reset-mid-chunk":
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                             b"100\r\ndata: {\"half\": ")  # fmt: skip
                await writer.drain()
                writer.transport.abort()
        except ConnectionError:
            pass

    async def send(url: str, case: str, tier: str, stream: bool = True) -> tuple[int, bytes]:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps({"model": "smollm2", "stream": stream,
                              "messages": [{"role": "user", "content": case}]}).encode()  # fmt: skip
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nx-hybridllm-tier: {tier}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        sc = relay.ChunkScanner(keep=True)
        if b"chunked" in head.lower():
            while not sc.done:
                data = await reader.read(65536)
                if not data:
                    break  # cut: the caller checks what arrived
                sc.feed(data)
            body = b"".join(sc.payload)
        else:
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        writer.close()
        return status, body if sc.done or b"chunked" not in head.lower() else b"CUT:" + body

    async def main() -> None:
        good_server = await asyncio.start_server(good, "127.0.0.1", 0)
        bad_server = await asyncio.start_server(hostile, "127.0.0.1", 0)
        routing = {
            "model": "smollm2", "policy": "auto",
            "rateLimits": {"requestsPerMinute": 10**6, "tokensPerMinute": 10**9},
            "tiers": {
                "edge": {"backends": [{"url": f"http://127.0.0.1:{good_server.sockets[0].getsockname()[1]}"}]},
                "cloud": {"backends": [{"url": f"http://127.0.0.1:{bad_server.sockets[0].getsockname()[1]}"}]},
            },
        }  # fmt: skip
        (tmp_path / "routing.json").write_text(json.dumps(routing))
        settings = config.GatewaySettings(
            config=tmp_path / "routing.json", first_byte_timeout_s=2, max_attempts=1,
            eject_after_failures=1000, max_upstream_body_bytes=1 << 20,
        )  # fmt: skip
        runner = web.AppRunner(app_mod.create_app(settings), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            goods = [send(url, "fine", "edge") for _ in range(40)]
            bads = [send(url, case, "cloud") for case in HOSTILE]
            bads.append(send(url, "whole-past-cap", "cloud", stream=False))
            bads.append(send(url, "slow-drip", "cloud", stream=False))  # the other path
            bads.append(send(url, "reset-mid-chunk", "cloud"))
            results = await asyncio.wait_for(asyncio.gather(*goods, *bads), timeout=60)
            async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                metrics = await resp.text()
        finally:
            await runner.cleanup()
            good_server.close()
            bad_server.close()
        good_results, bad_results = results[:40], results[40:]
        assert all(r == (200, b"".join(EVENTS)) for r in good_results), good_results[:2]
        cases = [*HOSTILE, "whole-past-cap", "slow-drip"]
        for case, (status, body) in zip(cases, bad_results, strict=False):
            assert status == 502, (case, status, body[:300])
            message = json.loads(body)["error"]["message"]
            want = HOSTILE[case][1] if case in HOSTILE else "answer is over 1048576 bytes"
            assert want in message, (case, message)
            assert "127.0.0.1" not in message, message
            assert "http://" not in message, message
        status, body = bad_results[-1]  # reset inside a chunk: the client's stream is cut
        assert status == 200
        assert body.startswith(b"CUT:"), body[:200]
        # the oversized answers were cut near the cap (plus what the kernel's socket buffers
        # took in), not read to their end
        assert len(offered) == 2, offered
        assert max(offered.values()) < 16 << 20, offered
        # the two that sent no first byte in time (one on each path) are counted as timeouts
        # (the autoscaler's saturation signal), not as read errors
        kinds = {
            s.labels["kind"]: s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "hybridllm_gateway_upstream_errors_total" and s.labels["tier"] == "cloud"
        }
        assert kinds["timeout"] == 2, kinds
        assert "read" not in kinds, kinds

    asyncio.run(main())


def test_the_request_model_decides_every_type_and_the_edge_limits_bind_every_route(
    tmp_path: Path,
) -> None:
    """Types are strict and decided once: "stream": "false" was false to the request model
    and true to the gateway (which then charged 0 tokens); "max_tokens": "100000" or
    100000.0 passed validation but skipped the gateway's cap and the edge limits. An
    image part was dropped in silence; an explicit edge tier skipped the edge limits; an
    unknown route said model_not_found. None of these reaches a backend now."""
    reached: list[bytes] = []

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reached.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()

    async def client(url: str) -> None:
        import aiohttp

        base = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
        refused = {
            "stream": ({"stream": "false"}, "stream"),
            "max_tokens": ({"max_tokens": "100000"}, "max_tokens"),
            "float max_tokens": ({"max_tokens": 100000.0}, "max_tokens"),
            "n": ({"n": "2"}, "n"),
            "image": ({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ]}]}, "messages.0.content"),
        }  # fmt: skip
        async with aiohttp.ClientSession() as http:
            for what, (fields, param) in refused.items():
                async with http.post(url + "/v1/chat/completions", json={**base, **fields}) as r:
                    error = (await r.json())["error"]
                    assert r.status == 400, (what, error)
                    assert error["param"] == param, (what, error)
            async with http.post(url + "/v1/chat/completions", json=base) as r:
                pass  # the one valid request: it reaches the backend
            edge = {**base, "max_tokens": 4096}  # over edgeLimits.maxOutputTokens (512)
            async with http.post(url + "/v1/chat/completions", json=edge,
                                 headers={"x-hybridllm-tier": "edge"}) as r:  # fmt: skip
                error = (await r.json())["error"]
                assert r.status == 400, error
                assert "maxOutputTokens" in error["message"], error
            async with http.get(url + "/v1/nope") as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "not_found"
        assert len(reached) == 1, reached

    served(tmp_path, upstream, client, both_tiers=True)
