"""The decode role's side of remote prefill: pick a prefill worker, receive blocks, retry.

``RemotePrefillClient`` implements ``llm_engine.RemotePrefill``. It runs an asyncio loop in
a thread of its own ("kv-connector"); the engine thread calls ``start`` / ``cancel`` /
``has_capacity`` and gets the outcome through the ``done`` callback, called exactly once per
transfer and only after the transfer has stopped writing blocks.

Choosing a worker: least outstanding transfers among the endpoints, skipping those in
back-off after a failure. Host names are resolved to every address at start and again
every ``resolve_interval`` seconds on the connector's loop (never on the engine thread).
``has_capacity`` is false when every worker already has ``max_inflight_per_worker``
transfers or is backing off; the engine then prefills locally (conditional
disaggregation).

Each received ``KV`` frame is checked (checksum, layer and block range within what was
asked, exact payload size) and written straight into the blocks the scheduler allocated.
``DONE`` is accepted only when every asked-for block of every layer has arrived. Any
failure before that (connection refused or reset, timeout, bad frame, retryable
``ERROR``) retries the whole transfer on another worker, up to ``retries`` times; blocks
already written are simply overwritten. Then the engine falls back to a local prefill.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridllm_cloud.disagg import protocol, transport
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.outputs import KVLoad, TokenLogprobs
from hybridllm_cloud.worker import model_runner
from hybridllm_common import backend_auth

log = logging.getLogger(__name__)

_TORCH_TO_WIRE = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


class TransferError(Exception):
    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass
class _Worker:
    endpoint: transport.Endpoint
    inflight: int = 0
    down_until: float = 0.0


@dataclass
class TransferStats:
    """Per-transfer numbers for metrics and benchmarks."""

    request_id: str
    outcome: str  # ok | failed | cancelled
    seconds: float
    bytes: int
    attempts: int
    endpoint: str | None = None
    errors: list[str] = field(default_factory=list)
    first_frame_s: float | None = None  # since start: queueing + compute before any block
    last_frame_s: float | None = None  # since start: the last block written here


class RemotePrefillClient:
    def __init__(
        self,
        endpoints: list[transport.Endpoint],
        runner: model_runner.ModelRunner,
        model_name: str,
        *,
        max_inflight_per_worker: int = 8,
        retries: int = 1,
        timeout: float = 30.0,
        backoff: float = 5.0,
        resolve_interval: float = 10.0,
        on_transfer: Callable[[TransferStats], None] | None = None,
        token: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("remote prefill needs at least one prefill endpoint")
        self.configured = list(endpoints)
        self.runner = runner
        cache = runner.kv_caches[0][0]
        self.layout = protocol.cache_layout(
            len(runner.kv_caches),
            runner.block_shape,
            protocol.tensor_dtype_name(cache.dtype),
            model_name,
        )
        self.num_layers = len(runner.kv_caches)
        self.block_shape = runner.block_shape
        self.dtype = cache.dtype
        self.block_bytes = int(np.prod(self.block_shape)) * cache.element_size()
        self.max_inflight = max_inflight_per_worker
        self.retries = retries
        self.timeout = timeout
        self.backoff = backoff
        self.resolve_interval = resolve_interval
        self.token = token  # the service's backend token, shown to its prefill workers
        self.on_transfer = on_transfer
        self.on_frame: Callable[[protocol.Frame], None] | None = None  # observers (tests)
        self._workers: dict[transport.Endpoint, _Worker] = {}
        self._lock = threading.Lock()
        self._tids = itertools.count(1)
        self._futures: dict[str, concurrent.futures.Future[None]] = {}
        self._started: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kv-connector", daemon=True
        )
        self._apply(transport.resolve(self.configured))

    # --- lifecycle ------------------------------------------------------------------------

    def start_thread(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._resolve_forever(), self._loop)

    async def _resolve_forever(self) -> None:
        """Re-resolves the endpoints off the engine thread (DNS may be slow)."""
        while True:
            await asyncio.sleep(self.resolve_interval)
            try:
                found = await self._loop.run_in_executor(None, transport.resolve, self.configured)
            except Exception:  # never let a resolver bug stop the loop
                log.exception("resolving prefill endpoints failed; keeping the last set")
                continue
            self._apply(found)

    def close(self) -> None:
        """Cancels open transfers (each still reports to its engine) and stops the loop."""
        if not self._thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # --- workers ----------------------------------------------------------------------------

    def _apply(self, found: list[transport.Endpoint]) -> None:
        with self._lock:
            for ep in found:
                self._workers.setdefault(ep, _Worker(ep))
            for ep in list(self._workers):
                if ep not in found and self._workers[ep].inflight == 0:
                    del self._workers[ep]

    def workers(self) -> list[_Worker]:
        with self._lock:
            return list(self._workers.values())

    def has_capacity(self) -> bool:
        now = time.monotonic()
        return any(w.down_until <= now and w.inflight < self.max_inflight for w in self.workers())

    def _pick(self, tried: set[transport.Endpoint]) -> _Worker | None:
        now = time.monotonic()
        with self._lock:
            live = [w for w in self._workers.values() if w.endpoint not in tried]
            ready = [w for w in live if w.down_until <= now and w.inflight < self.max_inflight]
            pool = ready or [w for w in live if w.down_until <= now]
            if not pool:
                return None
            worker = min(pool, key=lambda w: (w.inflight, w.endpoint))
            worker.inflight += 1
            return worker

    # --- transfers (engine thread -> connector loop) ---------------------------------------

    def start(
        self,
        load: KVLoad,
        done: Callable[[str, llm_engine.RemotePrefillResult | None], None],
    ) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._transfer(load, done), self._loop)
        self._futures[load.request_id] = fut
        fut.add_done_callback(lambda _: self._futures.pop(load.request_id, None))

    def cancel(self, request_id: str) -> None:
        fut = self._futures.get(request_id)
        if fut is not None:
            fut.cancel()

    async def _transfer(
        self, load: KVLoad, done: Callable[[str, llm_engine.RemotePrefillResult | None], None]
    ) -> None:
        start = time.monotonic()
        stats = TransferStats(load.request_id, "failed", 0.0, 0, 0)
        self._started[load.request_id] = start
        result: llm_engine.RemotePrefillResult | None = None
        tried: set[transport.Endpoint] = set()
        try:
            while stats.attempts <= self.retries:
                worker = self._pick(tried)
                if worker is None:
                    break
                tried.add(worker.endpoint)
                stats.attempts += 1
                stats.endpoint = str(worker.endpoint)
                try:
                    result = await self._attempt(worker.endpoint, load, stats)
                    stats.outcome = "ok"
                    break
                except TransferError as exc:
                    stats.errors.append(f"{worker.endpoint}: {exc}")
                    log.warning(
                        "%s: remote prefill on %s failed: %s", load.request_id, worker.endpoint, exc
                    )
                    if exc.retryable and "busy" not in str(exc):
                        worker.down_until = time.monotonic() + self.backoff
                    if not exc.retryable:
                        break
                finally:
                    with self._lock:
                        worker.inflight -= 1
        except asyncio.CancelledError:
            stats.outcome = "cancelled"
            result = None
        finally:
            self._started.pop(load.request_id, None)
            stats.seconds = time.monotonic() - start
            if self.on_transfer is not None:
                self.on_transfer(stats)
            done(load.request_id, result)

    async def _attempt(
        self, endpoint: transport.Endpoint, load: KVLoad, stats: TransferStats
    ) -> llm_engine.RemotePrefillResult:
        tid = next(self._tids)
        p = load.sampling_params
        request = {
            "request_id": load.request_id,
            "prompt_token_ids": load.prompt_token_ids,
            "first_block": load.first_block,
            "sampling": {
                "temperature": p.temperature,
                "top_p": p.top_p,
                "top_k": p.top_k,
                "seed": p.seed,
                "logprobs": p.logprobs,
                "cache_salt": p.cache_salt,
            },
            "layout": self.layout,
        }
        if self.token is not None:
            request["authorization"] = backend_auth.header(self.token)["authorization"]
        try:
            conn = await transport.connect(endpoint, self.timeout)
        except (OSError, TimeoutError) as exc:
            raise TransferError(f"connect: {exc or type(exc).__name__}") from exc
        try:
            await conn.send(protocol.json_frame(protocol.FrameType.PREFILL, tid, request))
            return await self._receive(conn, tid, load, stats)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise TransferError(
                f"connection lost mid-transfer ({exc or type(exc).__name__})"
            ) from exc
        except TimeoutError as exc:
            raise TransferError(f"no frame within {self.timeout:g} s") from exc
        except protocol.ProtocolError as exc:
            raise TransferError(str(exc)) from exc
        finally:
            conn.close()

    async def _receive(
        self, conn: protocol.Conn, tid: int, load: KVLoad, stats: TransferStats
    ) -> llm_engine.RemotePrefillResult:
        num_blocks = len(load.block_ids)
        missing = {
            (layer, b)
            for layer in range(self.num_layers)
            for b in range(load.first_block, num_blocks)
        }
        while True:
            frame = await asyncio.wait_for(conn.recv(), self.timeout)
            if frame.transfer_id != tid:
                raise protocol.ProtocolError(
                    f"frame of transfer {frame.transfer_id}, expected {tid}"
                )
            if frame.type == protocol.FrameType.KV:
                self._store(frame, load)
                stats.bytes += len(frame.payload)
                now = time.monotonic() - self._started.get(load.request_id, time.monotonic())
                if stats.first_frame_s is None:
                    stats.first_frame_s = now
                stats.last_frame_s = now
                for layer in range(frame.layer_start, frame.layer_start + frame.layer_count):
                    for b in range(frame.first_block, frame.first_block + frame.num_blocks):
                        missing.discard((layer, b))
                if self.on_frame is not None:
                    self.on_frame(frame)
                continue
            if frame.type == protocol.FrameType.ERROR:
                body = frame.json()
                raise TransferError(
                    f"prefill worker: {body.get('message')}", bool(body.get("retryable", True))
                )
            if frame.type != protocol.FrameType.DONE:
                raise protocol.ProtocolError(f"unexpected {frame.type.name} frame")
            if missing:
                raise protocol.ProtocolError(
                    f"DONE with {len(missing)} (layer, block) pairs missing"
                )
            body = frame.json()
            return llm_engine.RemotePrefillResult(
                token=int(body["token"]),
                logprobs=None
                if body.get("logprobs") is None
                else TokenLogprobs(**body["logprobs"]),
                generator_state=self._state(body.get("generator_state")),
            )

    def _store(self, frame: protocol.Frame, load: KVLoad) -> None:
        layers, first, n = frame.layer_count, frame.first_block, frame.num_blocks
        if (
            layers < 1
            or frame.layer_start + layers > self.num_layers
            or first < load.first_block
            or n < 1
            or first + n > len(load.block_ids)
        ):
            raise protocol.ProtocolError(
                f"KV frame for layers {frame.layer_start}+{layers}, blocks {first}+{n} is outside "
                f"the transfer ({self.num_layers} layers, blocks {load.first_block}..{len(load.block_ids)})"
            )
        expected = layers * 2 * n * self.block_bytes
        if len(frame.payload) != expected:
            raise protocol.ProtocolError(
                f"KV payload of {len(frame.payload)} bytes, expected {expected}"
            )
        wire = _TORCH_TO_WIRE.get(self.dtype, self.dtype)
        data = torch.frombuffer(frame.payload, dtype=wire).view(self.dtype)
        data = data.view(layers, 2, n, *self.block_shape)
        self.runner.write_blocks(
            frame.layer_start, load.block_ids[first : first + n], data[:, 0], data[:, 1]
        )

    @staticmethod
    def _state(encoded: str | None) -> torch.Tensor | None:
        if encoded is None:
            return None
        raw = base64.b64decode(encoded)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
