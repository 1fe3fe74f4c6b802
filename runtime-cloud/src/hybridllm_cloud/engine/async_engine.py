"""The engine in its own thread, fed from asyncio.

The HTTP side never runs engine code: it puts commands (add, abort) in a thread-safe
inbox and receives outputs on its own asyncio queue through ``call_soon_threadsafe``.
The engine thread drains the inbox between steps, so an abort (client disconnect) takes
effect at the next step boundary and frees the request's blocks there. With nothing to
do, the thread sleeps on an event that the next command sets, or, in the decode role, a
finished KV transfer (``engine.notify``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.engine.request import Priority, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, llm_engine.RequestOutput | BaseException]]
    tag: int


class AsyncEngine:
    def __init__(
        self,
        engine: llm_engine.LLMEngine,
        on_step: Callable[[llm_engine.EngineStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._sinks: dict[str, _Sink] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        engine.notify = self._wake.set
        self._pending_lock = threading.Lock()
        self.num_pending = 0  # added but not yet seen by the engine thread
        self.stats = engine.stats()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting + self.num_pending

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority,
        out: asyncio.Queue[tuple[int, llm_engine.RequestOutput | BaseException]],
        tag: int = 0,
        kv_export: tuple[int, llm_engine.ExportSink] | None = None,
    ) -> None:
        """Queues a request; its outputs arrive on ``out`` as ``(tag, output)``."""
        sink = _Sink(asyncio.get_running_loop(), out, tag)
        with self._pending_lock:
            self.num_pending += 1
        self._inbox.put(("add", (request_id, prompt_token_ids, params, priority, sink, kv_export)))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        """Blocks until no request is queued or running (tests, graceful shutdown)."""
        with self._idle:
            return self._idle.wait_for(
                lambda: (
                    not self.engine.has_unfinished() and self._inbox.empty() and not self._sinks
                ),
                timeout,
            )

    def _deliver(self, sink: _Sink, item: llm_engine.RequestOutput | BaseException) -> None:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.tag, item))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id, prompt, params, priority, sink, export = payload  # type: ignore[misc]
                with self._pending_lock:
                    self.num_pending -= 1
                try:
                    self.engine.add_request(request_id, prompt, params, priority, export)
                except ValueError as exc:
                    self._deliver(sink, exc)
                    continue
                self._sinks[request_id] = sink
            elif kind == "abort":
                request_id = str(payload)
                if self._sinks.pop(request_id, None) is not None:
                    self.engine.abort([request_id])
                    log.debug("aborted %s", request_id)

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.stats = self.engine.stats()
                with self._idle:
                    self._idle.notify_all()
                self._wake.wait()
                continue
            if not self.engine.has_schedulable():
                # Only requests waiting for remote KV: sleep until a transfer ends or a
                # command arrives (both set the event); the timeout is a safety net.
                self._wake.wait(timeout=1.0)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing all running requests")
                for request_id, sink in list(self._sinks.items()):
                    self._deliver(sink, RuntimeError(f"engine step failed: {exc}"))
                    self.engine.abort([request_id])
                self._sinks.clear()
                continue
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                self._deliver(sink, out)
                if out.finished:
                    del self._sinks[out.request_id]
            self.stats = self.engine.stats()
            if self.on_step is not None:
                self.on_step(self.stats)
