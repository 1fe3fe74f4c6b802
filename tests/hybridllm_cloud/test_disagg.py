"""Prefill -> decode through the real KV server and connector, against the monolithic engine.

A prefill engine runs behind a ``KVServer`` on a loopback port (its engine thread and an
asyncio loop thread, as in ``hybridllm-cloud serve --role prefill``); a decode engine uses
a ``RemotePrefillClient`` with ``local_prefill_threshold=0`` so that every prompt is
prefilled remotely. Faults are real: servers closed mid-transfer, a server that sends a
corrupt frame, a client that disappears, a server that never answers. After each, the block
accounting of every engine involved is checked: no request left, every block free.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridllm_cloud.disagg import connector, prefill_server, protocol, transport
from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.sampling_params import SamplingParams

CONFIG = llm_engine.EngineConfig(num_kv_blocks=192, block_size=4, max_model_len=256)
MODEL_ID = "tiny:test"

PROMPTS = [
    list(range(3, 3 + n)) if i % 2 == 0 else [(7 * j + i) % 380 + 3 for j in range(n)]
    for i, n in enumerate((5, 9, 16, 23, 31, 40))
]


class LoopThread:
    """An asyncio loop in a thread (the server's event loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class PrefillWorker:
    def __init__(self, model_dir: Path, loop: LoopThread) -> None:
        self.loop = loop
        self.engine = llm_engine.LLMEngine.from_path(model_dir, CONFIG)
        self.async_engine = async_engine.AsyncEngine(self.engine)
        self.async_engine.start()
        self.outcomes: list[str] = []

        async def start() -> tuple[prefill_server.KVServer, transport.Endpoint]:
            server = prefill_server.KVServer(
                self.async_engine,
                MODEL_ID,
                timeout=10,
                on_transfer=lambda outcome, _s, _b: self.outcomes.append(outcome),
            )
            return server, await server.start(transport.Endpoint("tcp", "127.0.0.1", 0))

        self.server, self.endpoint = loop.run(start())

    def kill(self) -> None:
        """Closes the listener and every open transfer at once (as a dying process would)."""
        self.loop.run(self.server.close())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()
        self.async_engine.shutdown()


def assert_idle(engine: llm_engine.LLMEngine) -> None:
    """No request left and every block back in the free queue."""
    assert not engine.has_unfinished()
    assert engine.kv.req_to_blocks == {}
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def wait_prefill_idle(worker: PrefillWorker) -> None:
    assert worker.async_engine.wait_idle(timeout=30)
    assert_idle(worker.engine)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def mono(tiny_model_dir: Path) -> llm_engine.LLMEngine:
    return llm_engine.LLMEngine.from_path(tiny_model_dir, CONFIG)


@pytest.fixture
def prefill(tiny_model_dir: Path, loop: LoopThread) -> Iterator[PrefillWorker]:
    worker = PrefillWorker(tiny_model_dir, loop)
    yield worker
    worker.close()


def make_decode(
    model_dir: Path, endpoints: list[transport.Endpoint], **kw: Any
) -> tuple[llm_engine.LLMEngine, connector.RemotePrefillClient, list[connector.TransferStats]]:
    engine = llm_engine.LLMEngine.from_path(
        model_dir,
        llm_engine.EngineConfig(
            num_kv_blocks=192,
            block_size=4,
            max_model_len=256,
            local_prefill_threshold=kw.pop("threshold", 0),
        ),
    )
    stats: list[connector.TransferStats] = []
    client = connector.RemotePrefillClient(
        endpoints,
        engine.runner,
        MODEL_ID,
        timeout=kw.pop("timeout", 10),
        on_transfer=stats.append,
        **kw,
    )
    client.start_thread()
    engine.use_remote_prefill(client)
    return engine, client, stats


@pytest.fixture
def decode_factory(
    tiny_model_dir: Path,
) -> Iterator[
    Callable[
        ...,
        tuple[llm_engine.LLMEngine, connector.RemotePrefillClient, list[connector.TransferStats]],
    ]
]:
    made: list[connector.RemotePrefillClient] = []

    def factory(endpoints: list[transport.Endpoint], **kw: Any) -> Any:
        engine, client, stats = make_decode(tiny_model_dir, endpoints, **kw)
        made.append(client)
        return engine, client, stats

    yield factory
    for client in made:
        client.close()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(
    engine: llm_engine.LLMEngine, prompts: list[list[int]], params: Any = GREEDY
) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_greedy_identical_to_monolithic_concurrent(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, decode_factory: Any
) -> None:
    decode, _, stats = decode_factory([prefill.endpoint])
    want = tokens(mono, PROMPTS)
    assert tokens(decode, PROMPTS) == want  # all six in flight at once
    assert decode.num_remote_prefills == len(PROMPTS)
    assert decode.num_local_prefills == 0
    assert {s.outcome for s in stats} == {"ok"}
    assert all(s.bytes > 0 for s in stats)
    assert_idle(decode)
    wait_prefill_idle(prefill)


def test_prefix_hits_on_either_side(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, decode_factory: Any
) -> None:
    want = tokens(mono, PROMPTS)
    decode, _, stats = decode_factory([prefill.endpoint])
    assert tokens(decode, PROMPTS) == want
    first_bytes = sum(s.bytes for s in stats)
    # Again: the decode side now holds the prefixes, so only the last blocks travel.
    assert tokens(decode, PROMPTS) == want
    assert decode.kv.prefix_hit_rate() > 0.4
    assert sum(s.bytes for s in stats[len(PROMPTS) :]) < first_bytes / 2
    # A fresh decode worker: prefix hits on the prefill side only; it must ship them.
    fresh, _, fresh_stats = decode_factory([prefill.endpoint])
    assert tokens(fresh, PROMPTS) == want
    assert prefill.engine.kv.prefix_hit_rate() > 0.2
    assert sum(s.bytes for s in fresh_stats) == first_bytes
    # A prompt that extends a cached one on both sides.
    longer = [PROMPTS[-1] + [5, 6, 7, 8, 9, 10, 11]]
    assert tokens(decode, longer) == tokens(mono, longer)
    for engine in (decode, fresh):
        assert_idle(engine)
    wait_prefill_idle(prefill)


def test_seeded_sampling_and_logprobs_identical(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, decode_factory: Any
) -> None:
    decode, _, _ = decode_factory([prefill.endpoint])
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=3)
        for i in range(len(PROMPTS))
    ]
    want = mono.generate(PROMPTS, params)
    got = decode.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert decode.num_remote_prefills == len(PROMPTS)
    assert_idle(decode)


def test_short_prompts_stay_local(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, decode_factory: Any
) -> None:
    decode, _, stats = decode_factory([prefill.endpoint], threshold=20)
    prompts = [PROMPTS[i] for i in (0, 1, 3, 5)]  # no shared prefixes: 5, 9, 23, 40 tokens
    assert tokens(decode, prompts) == tokens(mono, prompts)
    assert decode.num_remote_prefills == 2
    assert decode.num_local_prefills == 2
    assert len(stats) == 2
    # The threshold counts uncached tokens: 24 tokens of which 20 are cached stay local.
    assert tokens(decode, [PROMPTS[3] + [9]]) == tokens(mono, [PROMPTS[3] + [9]])
    assert decode.num_local_prefills == 3


def test_no_prefill_worker_reachable_falls_back_local(
    mono: llm_engine.LLMEngine, tiny_model_dir: Path, loop: LoopThread, decode_factory: Any
) -> None:
    dead = PrefillWorker(tiny_model_dir, loop)
    dead.close()  # its port now refuses connections
    decode, client, stats = decode_factory([dead.endpoint], retries=0)
    assert tokens(decode, PROMPTS[:2]) == tokens(mono, PROMPTS[:2])
    assert stats[0].outcome == "failed"
    assert "connect" in stats[0].errors[0]
    # The worker is backing off now: no capacity, so later prompts go local without trying.
    assert not client.has_capacity()
    assert decode.num_remote_failures >= 1
    assert_idle(decode)


def test_prefill_dies_mid_transfer_retried_on_another(
    mono: llm_engine.LLMEngine, tiny_model_dir: Path, loop: LoopThread, decode_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    a, b = PrefillWorker(tiny_model_dir, loop), PrefillWorker(tiny_model_dir, loop)
    try:
        decode, client, stats = decode_factory([a.endpoint, b.endpoint])
        # a is the first pick (ties break on the endpoint); kill it after its first KV frame.
        first = min([a, b], key=lambda w: w.endpoint)
        second = b if first is a else a
        killed = threading.Event()
        # The first transfer's server holds after its first KV frame until it is killed: its
        # whole transfer (20 kB) otherwise fits the socket's buffers before the kill lands,
        # and on a busy machine the client read it all, DONE included (one attempt).
        send, held = protocol.Conn.send, []

        async def send_then_hold(conn: protocol.Conn, frame: protocol.Frame) -> None:
            await send(conn, frame)
            if frame.type == protocol.FrameType.KV and not held:
                held.append(frame)
                await asyncio.Event().wait()  # cancelled by the kill

        monkeypatch.setattr(protocol.Conn, "send", send_then_hold)

        def on_frame(frame: protocol.Frame) -> None:
            if not killed.is_set():
                killed.set()
                asyncio.run_coroutine_threadsafe(first.server.close(), loop.loop)

        client.on_frame = on_frame
        prompt = [PROMPTS[-1]]
        assert tokens(decode, prompt) == tokens(mono, prompt)
        assert killed.is_set()
        assert len(held) == 1
        (st,) = stats
        assert st.outcome == "ok"
        assert st.attempts == 2
        assert st.endpoint == str(second.endpoint)
        assert "connection lost" in st.errors[0]
        assert_idle(decode)
        wait_prefill_idle(first)  # the killed transfer's request was aborted, blocks freed
        wait_prefill_idle(second)
    finally:
        a.close()
        b.close()


async def _bad_server(handler: Callable[..., Any]) -> tuple[transport.Server, transport.Endpoint]:
    server = await transport.start_server(transport.Endpoint("tcp", "127.0.0.1", 0), handler)
    return server, transport.Endpoint("tcp", "127.0.0.1", server.address[1])


def test_corrupt_frame_is_retried_elsewhere(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, loop: LoopThread, decode_factory: Any
) -> None:
    async def corrupt(conn: protocol.Conn) -> None:
        frame = await conn.recv()
        payload = b"\x00" * 64
        bad = protocol.Frame(protocol.FrameType.KV, frame.transfer_id, payload, 0, 1, 0, 1)
        await conn.send_raw(protocol.encode_header(bad, crc=12345) + payload)
        await conn.wait_closed_by_peer()

    server, endpoint = loop.run(_bad_server(corrupt))
    try:
        # The corrupt server sorts first or second; either way the transfer must end on the good one.
        decode, _, stats = decode_factory([endpoint, prefill.endpoint])
        assert tokens(decode, PROMPTS) == tokens(mono, PROMPTS)
        assert all(s.outcome == "ok" for s in stats)
        assert any("checksum mismatch" in e for s in stats for e in s.errors)
        assert_idle(decode)
        wait_prefill_idle(prefill)
    finally:
        loop.run(server.close())


def test_decode_side_disappears_mid_transfer(prefill: PrefillWorker, loop: LoopThread) -> None:
    """The prefill worker aborts the request and frees its blocks when its peer is gone."""

    async def half_transfer() -> int:
        conn = await transport.connect(prefill.endpoint, 10)
        layout = prefill.server.layout
        req = {
            "request_id": "gone",
            "prompt_token_ids": list(range(3, 203)),
            "first_block": 0,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
            "layout": layout,
        }
        await conn.send(protocol.json_frame(protocol.FrameType.PREFILL, 1, req))
        frame = await conn.recv()
        conn.abort()  # reset, like a killed process
        return frame.layer_start

    assert loop.run(half_transfer()) == 0
    wait_prefill_idle(prefill)
    assert prefill.outcomes
    assert prefill.outcomes[-1] in ("peer_lost", "error")


def test_abort_while_kv_in_flight_frees_blocks_after_transfer_stops(
    loop: LoopThread, decode_factory: Any
) -> None:
    got_request = threading.Event()
    release = asyncio.Event()

    async def silent(conn: protocol.Conn) -> None:
        await conn.recv()
        got_request.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(release.wait(), 30)

    server, endpoint = loop.run(_bad_server(silent))
    try:
        decode, _, stats = decode_factory([endpoint])
        decode.add_request("r1", PROMPTS[-1], GREEDY)
        assert decode.step() == []  # admitted as a remote prefill: holds its blocks
        assert "r1" in decode.scheduler.remote
        assert decode.kv.pool.num_used_blocks == decode.kv.num_blocks_for(len(PROMPTS[-1]))
        assert got_request.wait(10)
        decode.abort(["r1"])
        # Blocks stay taken until the connector confirms the transfer stopped writing.
        while decode.has_unfinished():
            decode._remote_event.wait(10)
            decode._remote_event.clear()
            decode.step()
        assert stats[0].outcome == "cancelled"
        assert_idle(decode)
    finally:
        loop.loop.call_soon_threadsafe(release.set)
        loop.run(server.close())


def test_layout_mismatch_is_not_retried(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, decode_factory: Any
) -> None:
    decode, client, stats = decode_factory([prefill.endpoint])
    client.layout = {**client.layout, "model": "other:model"}
    assert tokens(decode, PROMPTS[:1]) == tokens(mono, PROMPTS[:1])
    assert stats[0].outcome == "failed"
    assert stats[0].attempts == 1
    assert "layout mismatch" in stats[0].errors[0]
    assert decode.num_local_prefills == 0
    assert decode.num_remote_failures == 1


def test_the_kv_port_serves_only_decode_workers_with_the_services_token(
    mono: llm_engine.LLMEngine, prefill: PrefillWorker, loop: LoopThread, decode_factory: Any
) -> None:
    """Issue #59: the KV port computed a prefill for anyone who could reach it (a prompt's
    KV blocks and first token, for any prompt). With the pod's backend token set, a
    PREFILL request without it is refused by name and not retried; the service's own decode
    workers, which carry it, are served."""
    token = "t" * 40

    async def start() -> tuple[prefill_server.KVServer, transport.Endpoint]:
        server = prefill_server.KVServer(prefill.async_engine, MODEL_ID, timeout=10, token=token)
        return server, await server.start(transport.Endpoint("tcp", "127.0.0.1", 0))

    guarded, endpoint = loop.run(start())
    try:
        decode, _, stats = decode_factory([endpoint])
        assert tokens(decode, PROMPTS[:1]) == tokens(mono, PROMPTS[:1])
        assert (stats[0].outcome, stats[0].attempts) == ("failed", 1)
        assert "unauthorized" in stats[0].errors[0]
        for wrong in ("x" * 40, token):
            decode, _, stats = decode_factory([endpoint], token=wrong)
            assert tokens(decode, PROMPTS[:1]) == tokens(mono, PROMPTS[:1])
            assert stats[0].outcome == ("ok" if wrong == token else "failed")
    finally:
        loop.run(guarded.close())
        wait_prefill_idle(prefill)


def test_frame_roundtrip_and_checksum() -> None:
    payload = torch.arange(64, dtype=torch.float32).numpy().tobytes()
    frame = protocol.Frame(protocol.FrameType.KV, 9, payload, 2, 1, 5, 3)

    async def roundtrip(data: bytes) -> protocol.Frame:
        a, b = socket.socketpair()
        sender, receiver = protocol.Conn(a), protocol.Conn(b)
        await sender.send_raw(data)
        sender.close()
        try:
            return await receiver.recv()
        finally:
            receiver.close()

    got = asyncio.run(roundtrip(protocol.encode_header(frame) + payload))
    assert (got.type, got.transfer_id, got.layer_start, got.first_block, got.num_blocks) == (
        protocol.FrameType.KV,
        9,
        2,
        5,
        3,
    )
    assert bytes(got.payload) == payload
    flipped = bytearray(payload)
    flipped[10] ^= 1
    with pytest.raises(protocol.ProtocolError, match="checksum"):
        asyncio.run(roundtrip(protocol.encode_header(frame) + bytes(flipped)))
    with pytest.raises(protocol.ProtocolError, match="magic"):
        asyncio.run(roundtrip(b"XXXX" + protocol.encode_header(frame)[4:] + payload))


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("tcp://10.0.0.1:8001", True),
        ("demo-prefill.ns.svc:8001", True),
        ("unix:///tmp/kv.sock", True),
        ("http://h:80", True),
        ("h", False),
        ("tcp://h:0", False),
        ("tcp://:80", False),
        ("unix://", False),
    ],
)
def test_parse_endpoint(text: str, ok: bool) -> None:
    if ok:
        assert transport.parse_endpoint(text)
    else:
        with pytest.raises(ValueError, match=r"expected|path"):
            transport.parse_endpoint(text)
