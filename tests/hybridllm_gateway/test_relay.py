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

import pytest
from aiohttp import web

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


def test_bad_chunk_size_is_an_upstream_error() -> None:
    with pytest.raises(relay.UpstreamError, match="bad chunk size"):
        relay.ChunkScanner().feed(b"zz\r\nhello\r\n")


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
    tmp_path: Path, upstream_port: int, stream_relay: str = "raw"
) -> tuple[web.AppRunner, str]:
    routing = {
        "model": "smollm2",
        "policy": "cloud-only",
        "rateLimits": {"requestsPerMinute": 10**6, "tokensPerMinute": 10**9},
        "tiers": {"cloud": {"backends": [{"url": f"http://127.0.0.1:{upstream_port}"}]}},
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
) -> None:
    """Runs ``client(gateway_url)`` against a gateway in front of ``upstream``, then stops both."""

    async def main() -> None:
        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        runner, url = await start_gateway(tmp_path, port, stream_relay)
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
