"""The engine in its own thread, fed from asyncio.

The HTTP side never runs engine code: it puts commands (add, abort) in a thread-safe
inbox and receives outputs on its own asyncio queue through ``call_soon_threadsafe``.
The engine thread drains the inbox between steps, so an abort (client disconnect) takes
effect at the next step boundary and frees the request's blocks there. With nothing to
do, the thread sleeps on an event that the next command sets, or, in the decode role, a
finished KV transfer (``engine.notify``).

**A failed step fails only the request that caused it.** A step runs every scheduled
request in one batch, so an exception does not say whose it was. The engine then
isolates: every request of the step leaves the schedule (recompute-preempted, generated
tokens kept, and its blocks' prefix-cache entries dropped, since their K/V may be
half-written) and each is run alone for one step, the others held; new arrivals queue
behind them. A request that fails alone is failed with an error (its stream gets an
error event); one that passes waits, paused, until every suspect has been probed, and then
all continue together. A request caught in ``MAX_STRIKES`` failed batches without ever
failing alone (a failure only some batches trigger) is failed too, so isolation always
ends. ``num_step_failures`` and ``num_requests_failed`` count both, for the metrics.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.engine.request import Priority
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_common import structured

log = logging.getLogger(__name__)

MAX_STRIKES = 3


class RequestFailed(RuntimeError):
    """The engine failed this request (and only this one); the server answers 500."""


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
        # Isolation of a failed step (see the module docstring); engine thread only.
        self._suspects: collections.deque[str] = collections.deque()
        self._probe: str | None = None
        self._cleared: list[str] = []
        self._strikes: dict[str, int] = {}
        self.num_step_failures = 0
        self.num_requests_failed = 0

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
        grammar: structured.Matcher | None = None,
    ) -> None:
        """Queues a request; its outputs arrive on ``out`` as ``(tag, output)``.
        ``grammar``: its structured output's matcher, built off the step loop."""
        sink = _Sink(asyncio.get_running_loop(), out, tag)
        with self._pending_lock:
            self.num_pending += 1
        self._inbox.put(
            ("add", (request_id, prompt_token_ids, params, priority, sink, kv_export, grammar))
        )
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
                request_id, prompt, params, priority, sink, export, grammar = payload  # type: ignore[misc]
                with self._pending_lock:
                    self.num_pending -= 1
                try:
                    self.engine.add_request(request_id, prompt, params, priority, export, grammar)
                except ValueError as exc:
                    self._deliver(sink, exc)
                    continue
                self._sinks[request_id] = sink
                if self._isolating and self.engine.scheduler.hold(request_id):
                    self._cleared.append(request_id)  # new: innocent, waits for the probes
            elif kind == "abort":
                request_id = str(payload)
                if self._sinks.pop(request_id, None) is not None:
                    self.engine.abort([request_id])
                    self._forget(request_id)
                    log.debug("aborted %s", request_id)

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()
            self._drain_inbox()
            if self._isolating and self._probe is None:
                self._next_probe()
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
            except Exception as exc:  # noqa: BLE001 (isolated and logged by _on_step_failure)
                self._on_step_failure(exc)
                continue
            if self._probe is not None:  # it passed a step alone
                if self.engine.scheduler.hold(self._probe):
                    self._cleared.append(self._probe)
                self._probe = None
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

    # --- isolation of a failed step (engine thread) -----------------------------------------

    @property
    def _isolating(self) -> bool:
        return bool(self._suspects or self._probe is not None or self._cleared)

    def _next_probe(self) -> None:
        """Release the next suspect alone; with none left, every paused request together."""
        while self._suspects:
            request_id = self._suspects.popleft()
            if self.engine.scheduler.release(request_id):
                self._probe = request_id
                return
        for request_id in self._cleared:
            self.engine.scheduler.release(request_id)
        log.info("isolation over: %d request(s) continue", len(self._cleared))
        self._cleared.clear()

    def _on_step_failure(self, exc: Exception) -> None:
        self.num_step_failures += 1
        probe, self._probe = self._probe, None
        ids = self.engine.scheduler.hold_running(drop_cached=True)
        if len(ids) == 1 or (probe is not None and ids == [probe]):
            log.error("request %s failed alone in an engine step", ids[0], exc_info=exc)
            self._fail(ids[0], exc)
            return
        log.warning(
            "an engine step of %d requests failed (%s: %s); running each alone to find which",
            len(ids),
            type(exc).__name__,
            exc,
        )
        for request_id in ids:
            strikes = self._strikes.get(request_id, 0) + 1
            self._strikes[request_id] = strikes
            if strikes >= MAX_STRIKES:
                log.error("request %s was in %d failed steps: failing it", request_id, strikes)
                self._fail(request_id, exc)
            else:
                self._suspects.append(request_id)
        if not ids:
            log.error("an engine step failed with no request running", exc_info=exc)

    def _fail(self, request_id: str, exc: Exception) -> None:
        self.num_requests_failed += 1
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._deliver(
                sink, RequestFailed(f"the engine failed this request ({type(exc).__name__})")
            )
        self.engine.abort([request_id])
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._strikes.pop(request_id, None)
        if request_id in self._suspects:
            self._suspects.remove(request_id)
        if request_id in self._cleared:
            self._cleared.remove(request_id)
        if self._probe == request_id:
            self._probe = None
