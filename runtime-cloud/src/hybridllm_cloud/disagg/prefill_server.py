"""The prefill role's KV server: runs prompts for decode workers and streams their KV.

One connection is one transfer: a ``PREFILL`` frame in, ``KV`` frames and ``DONE`` (or
``ERROR``) out. The request enters the same ``AsyncEngine`` as HTTP requests, with
``max_tokens=1`` and a ``_TransferSink`` as its KV export. The engine thread calls the
sink after every layer with copies of the finished blocks; the sink forwards them to this
connection's asyncio queue, on which the engine also delivers the request's output, so
every KV frame precedes ``DONE``.

Back-pressure: the sink counts bytes handed over but not yet written to the socket
(``max_buffered_bytes``). When the decode side reads too slowly, the engine thread waits in
``put`` (the prefill pool slows down rather than buffering without bound) and after
``timeout`` seconds gives up: the transfer fails and its request is aborted.

A decode worker that goes away (EOF or reset on the connection) aborts the request at the
next step boundary, which frees its blocks; nothing else is shared with the connection.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridllm_cloud.disagg import protocol, transport
from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.engine.request import Priority
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_common import backend_auth

log = logging.getLogger(__name__)

_KV = -1  # tag of KV items on a transfer's queue (engine outputs carry tag 0)


class _TransferSink:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue[Any], limit: int, timeout: float
    ) -> None:
        self.loop = loop
        self.out = out
        self.limit = limit
        self.timeout = timeout
        self.buffered = 0
        self.closed = False
        self.cond = threading.Condition()

    def put(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        size = k.numel() * k.element_size() * 2
        with self.cond:
            ok = self.cond.wait_for(
                lambda: self.closed or self.buffered == 0 or self.buffered + size <= self.limit,
                self.timeout,
            )
            if not ok or self.closed:
                return False
            self.buffered += size
        self.loop.call_soon_threadsafe(self.out.put_nowait, (_KV, (layer, first_block, k, v)))
        return True

    def release(self, size: int) -> None:
        with self.cond:
            self.buffered -= size
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _payload(k: torch.Tensor, v: torch.Tensor) -> memoryview:
    """K then V, raw bytes of the cache dtype, as one contiguous buffer (one copy)."""
    both = torch.stack([k, v]).cpu().contiguous()
    if both.dtype in (torch.bfloat16, torch.float16):
        both = both.view(torch.int16)
    return memoryview(both.numpy()).cast("B")


def _state_b64(state: torch.Tensor | None) -> str | None:
    if state is None:
        return None
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


class KVServer:
    def __init__(
        self,
        engine: async_engine.AsyncEngine,
        model_name: str,
        *,
        max_waiting: int = 64,
        max_buffered_bytes: int = 256 << 20,
        timeout: float = 30.0,
        on_transfer: Callable[[str, float, int], None] | None = None,
        token: str | None = None,
    ) -> None:
        self.engine = engine
        runner = engine.engine.runner
        self.layout = protocol.cache_layout(
            len(runner.kv_caches),
            runner.block_shape,
            protocol.tensor_dtype_name(runner.kv_caches[0][0].dtype),
            model_name,
        )
        self.max_waiting = max_waiting
        self.max_buffered_bytes = max_buffered_bytes
        self.timeout = timeout
        self.on_transfer = on_transfer  # (outcome, seconds, bytes sent)
        # The pod's backend token (hybridllm_common.backend_auth): a PREFILL request must
        # carry it, or the KV port answers nobody but the service's own decode workers.
        self.token = token
        self.active = 0
        self._ids = itertools.count()
        self._servers: list[transport.Server] = []

    async def start(self, endpoint: transport.Endpoint) -> transport.Endpoint:
        """Listens; returns the bound endpoint (port 0 picks a free one)."""
        server = await transport.start_server(endpoint, self._handle)
        self._servers.append(server)
        if endpoint.scheme == "tcp":
            host, port = server.address[:2]
            endpoint = transport.Endpoint("tcp", host, port)
        log.info("KV server listening on %s", endpoint)
        return endpoint

    async def close(self) -> None:
        """Stops listening and drops every open transfer (their requests are aborted)."""
        servers, self._servers = self._servers, []
        for server in servers:
            await server.close()

    async def _handle(self, conn: protocol.Conn) -> None:
        self.active += 1
        start, sent, outcome = time.monotonic(), 0, "error"
        try:
            outcome, sent = await self._serve(conn)
        except (OSError, asyncio.IncompleteReadError) as exc:
            outcome = "peer_lost"
            log.info("KV transfer: decode side went away (%s)", exc)
        except protocol.ProtocolError as exc:
            log.warning("KV transfer: %s", exc)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.active -= 1
            if self.on_transfer is not None:
                self.on_transfer(outcome, time.monotonic() - start, sent)

    async def _error(self, conn: protocol.Conn, tid: int, message: str, retryable: bool) -> None:
        frame = protocol.json_frame(
            protocol.FrameType.ERROR, tid, {"message": message, "retryable": retryable}
        )
        with contextlib.suppress(ConnectionError):
            await conn.send(frame)

    async def _serve(self, conn: protocol.Conn) -> tuple[str, int]:
        frame = await asyncio.wait_for(conn.recv(), self.timeout)
        if frame.type != protocol.FrameType.PREFILL:
            raise protocol.ProtocolError(f"expected PREFILL, got {frame.type.name}")
        tid = frame.transfer_id
        req = frame.json()
        if self.token is not None and not backend_auth.matches(
            self.token, str(req.get("authorization") or "")
        ):
            await self._error(
                conn, tid, "unauthorized: a PREFILL request must carry the service's backend "
                "token", retryable=False,
            )  # fmt: skip
            return "unauthorized", 0
        if req.get("layout") != self.layout:
            await self._error(
                conn,
                tid,
                f"cache layout mismatch: decode {req.get('layout')}, prefill {self.layout}",
                retryable=False,
            )
            return "layout_mismatch", 0
        if self.engine.num_waiting >= self.max_waiting:
            await self._error(conn, tid, "prefill worker busy", retryable=True)
            return "busy", 0
        try:
            prompt = [int(t) for t in req["prompt_token_ids"]]
            first_block = int(req["first_block"])
            s = req["sampling"]
            params = SamplingParams(
                max_tokens=1,
                temperature=float(s["temperature"]),
                top_p=float(s["top_p"]),
                top_k=int(s["top_k"]),
                seed=None if s.get("seed") is None else int(s["seed"]),
                ignore_eos=True,
                logprobs=None if s.get("logprobs") is None else int(s["logprobs"]),
                cache_salt=str(s.get("cache_salt") or ""),
            )
            priority = Priority(int(req.get("priority", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            await self._error(conn, tid, f"bad PREFILL request: {exc}", retryable=False)
            return "bad_request", 0

        loop = asyncio.get_running_loop()
        out: asyncio.Queue[Any] = asyncio.Queue()
        sink = _TransferSink(loop, out, self.max_buffered_bytes, self.timeout)
        request_id = f"{req.get('request_id', 'remote')}-p{next(self._ids)}"
        self.engine.add(request_id, prompt, params, priority, out, kv_export=(first_block, sink))
        peer_gone = asyncio.ensure_future(conn.wait_closed_by_peer())
        sent, finished = 0, False
        get: asyncio.Future[Any] | None = None
        try:
            while True:
                get = asyncio.ensure_future(out.get())
                done, _ = await asyncio.wait(
                    {get, peer_gone}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if get not in done:
                    get.cancel()
                    if peer_gone in done:
                        raise ConnectionResetError("decode side closed the connection")
                    await self._error(conn, tid, "prefill timed out", retryable=True)
                    return "timeout", sent
                tag, item = get.result()
                if tag == _KV:
                    layer, block, k, v = item
                    payload = _payload(k, v)
                    await conn.send(
                        protocol.Frame(
                            protocol.FrameType.KV, tid, payload, layer, 1, block, k.shape[0]
                        )
                    )
                    sent += len(payload)
                    sink.release(len(payload))
                    continue
                if isinstance(item, BaseException):
                    await self._error(conn, tid, str(item), retryable=False)
                    finished = True
                    return "rejected", sent
                result: llm_engine.RequestOutput = item
                finished = result.finished
                if not finished:
                    continue
                lp = result.new_logprobs[0] if result.new_logprobs else None
                done_frame = protocol.json_frame(
                    protocol.FrameType.DONE,
                    tid,
                    {
                        "token": result.new_token_ids[0],
                        "logprobs": None
                        if lp is None
                        else {
                            "logprob": lp.logprob,
                            "top_token_ids": lp.top_token_ids,
                            "top_logprobs": lp.top_logprobs,
                        },
                        "generator_state": _state_b64(result.generator_state),
                        "num_cached_tokens": result.num_cached_tokens,
                    },
                )
                await conn.send(done_frame)
                return "ok", sent
        finally:
            sink.close()
            peer_gone.cancel()
            if get is not None and not get.done():
                get.cancel()  # cancelled mid-wait (server closing): no task left pending
            if not finished:
                self.engine.abort(request_id)
