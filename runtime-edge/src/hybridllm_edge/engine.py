"""The engine thread: continuous batching of up to ``num_slots`` requests over one backend.

One thread owns the backend (the llama.cpp context is not thread-safe); the HTTP side talks
to it through a thread-safe inbox (add, abort) and gets outputs through a callback per
request that hands them to its asyncio queue. Each step, the way llama.cpp's server runs
its slots:

1. drain the inbox: queue new requests, drop aborted ones (their slot's KV is released
   at once, so a cancelled request frees its memory before the next step);
2. give free slots to waiting requests, first come first served, the lowest free slot
   first: running slots stay a run of consecutive ids, which llama.cpp decodes in one
   micro-batch (a gap splits the step in two, see ``backends/llamacpp.py``);
3. build one batch under a token budget: every decoding slot's last sampled token first
   (decode is never starved by a long prompt), then prompt chunks of prefilling slots with
   what budget is left (chunked prefill);
4. one ``backend.forward``; sample for every slot that asked for logits, detokenize,
   check stop conditions, emit an output; finished requests release their slots.
"""

from __future__ import annotations

import codecs
import collections
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridllm_edge import sampling
from hybridllm_edge.backends import Backend, SlotWork

log = logging.getLogger(__name__)


@dataclass
class Output:
    """What one step produced for one request (``new_*``), plus running totals."""

    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[sampling.Choice]
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    mean_logprob: float | None = None
    text: str = ""  # the whole completion so far, set when finished


Emit = Callable[[Output | BaseException], None]


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: sampling.SamplingParams
    emit: Emit
    arrival: float = field(default_factory=time.monotonic)
    # --- engine-owned state below ---
    slot: int = -1
    num_cached: int = 0  # tokens already in the slot's KV
    output_ids: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    text: str = ""  # decoded completion text
    num_emitted_chars: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    rng: np.random.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_slots: int
    last_batch_size: int
    last_num_tokens: int


class Engine:
    def __init__(
        self,
        backend: Backend,
        max_num_batched_tokens: int,
        on_step: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self.backend = backend
        self.info = backend.info
        self.budget = max_num_batched_tokens
        self.on_step = on_step
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: list[EngineRequest] = []
        self._free_slots = list(range(self.info.num_slots))  # a heap: lowest slot first
        self._num_waiting = 0  # in the inbox, not yet seen by the engine; under _count_lock
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._is_idle = True  # set by the engine only at the end of a loop (after releases)

    # --- other threads ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="edge-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.backend.close()

    def add(self, request: EngineRequest) -> None:
        with self._idle, self._count_lock:  # one step with the idle flag: no false idle
            self._is_idle = False
            self._num_waiting += 1
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def wait_idle(self, timeout: float) -> bool:
        """True once no request is queued or running (tests, graceful shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._is_idle, timeout=timeout)

    # --- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self._running and not self._waiting
            self._drain(block)
            self._admit()
            if self._running:
                self._step()
            with self._idle:
                self._is_idle = not self._running and not self._waiting and self._num_waiting == 0
                self._idle.notify_all()

    def _drain(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=None) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add":
                assert isinstance(item, EngineRequest)
                self._waiting.append(item)
                with self._count_lock:
                    self._num_waiting -= 1
            elif kind == "abort":
                self._abort(str(item))
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_id: str) -> None:
        for req in list(self._waiting):
            if req.request_id == request_id:
                self._waiting.remove(req)
        for req in list(self._running):
            if req.request_id == request_id:
                self._finish(req)

    def _admit(self) -> None:
        while self._free_slots and self._waiting:
            req = self._waiting.popleft()
            req.slot = heapq.heappop(self._free_slots)
            if req.params.temperature > 0:
                req.rng = np.random.default_rng(req.params.seed)
            self._running.append(req)

    def _step(self) -> None:
        work: list[SlotWork] = []
        wanting: list[EngineRequest] = []
        budget = self.budget
        decoding = [r for r in self._running if len(r.tokens) - r.num_cached == 1]
        prefilling = [r for r in self._running if len(r.tokens) - r.num_cached > 1]
        for req in decoding + prefilling:
            if budget <= 0:
                break
            pending = req.tokens[req.num_cached :]
            chunk = pending[:budget]
            done = len(chunk) == len(pending)
            work.append(SlotWork(req.slot, chunk, req.num_cached, want_logits=done))
            budget -= len(chunk)
            if done:
                wanting.append(req)
        try:
            logits = self.backend.forward(work)
        except Exception as exc:
            log.exception("backend step failed; failing its %d requests", len(work))
            for req in [r for r in self._running if any(w.slot == r.slot for w in work)]:
                req.emit(exc)
                self._finish(req)
            return
        for item in work:
            req = next(r for r in self._running if r.slot == item.slot)
            req.num_cached += len(item.token_ids)
        for row, req in enumerate(wanting):
            self._on_token(req, logits[row])
        if self.on_step is not None:
            self.on_step(
                EngineStats(
                    num_running=len(self._running),
                    num_waiting=len(self._waiting) + self._num_waiting,
                    num_slots=self.info.num_slots,
                    last_batch_size=len(work),
                    last_num_tokens=sum(len(w.token_ids) for w in work),
                )
            )

    def _on_token(self, req: EngineRequest, logits: np.ndarray) -> None:
        params = req.params
        choice = sampling.sample(logits, params, req.rng, req.output_ids)
        token = choice.token_id
        req.output_ids.append(token)
        req.logprob_sum += choice.logprob
        reason: str | None = None
        eos = token in self.info.eos_token_ids and not params.ignore_eos
        if eos or token in params.stop_token_ids:
            reason = "stop"
        else:
            req.text += req.decoder.decode(self.backend.token_bytes(token))
        hold = 0
        if reason is None and params.stop:
            start = max(0, req.num_emitted_chars - max(len(s) for s in params.stop))
            hits = [i for s in params.stop if (i := req.text.find(s, start)) >= 0]
            if hits:
                req.text, reason = req.text[: min(hits)], "stop"
            else:
                hold = max(len(s) for s in params.stop) - 1
        if reason is None and (
            len(req.output_ids) >= params.max_tokens or len(req.tokens) >= self.info.max_model_len
        ):
            reason = "length"
        if reason is not None:
            req.text += req.decoder.decode(b"", final=True) if not eos else ""
            hold = 0
        end = max(req.num_emitted_chars, len(req.text) - hold)
        new_text = req.text[req.num_emitted_chars : end]
        req.num_emitted_chars = end
        n_out = len(req.output_ids)
        req.emit(
            Output(
                new_text=new_text,
                new_token_ids=[token],
                new_logprobs=[choice],
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=len(req.prompt_ids),
                num_output_tokens=n_out,
                mean_logprob=req.logprob_sum / n_out,
                text=req.text if reason is not None else "",
            )
        )
        if reason is not None:
            self._finish(req)

    def _finish(self, req: EngineRequest) -> None:
        self._running.remove(req)
        self.backend.release(req.slot)
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1
