"""The engine thread: continuous batching of up to ``num_slots`` requests over one backend.

One thread owns the backend (the llama.cpp context is not thread-safe); the HTTP side talks
to it through a thread-safe inbox (add, abort) and gets outputs through a callback per
request that hands them to its asyncio queue. Each step, the way llama.cpp's server runs
its slots:

1. drain the inbox: queue new requests, drop aborted ones (their slot's KV is released
   at once, so a cancelled request frees its memory before the next step);
2. give free slots to waiting requests, first come first served: the free slot whose KV
   still holds the longest prefix of the request's prompt, when that prefix is at least
   ``MIN_PREFIX_TOKENS`` (the prompt cache: the slot keeps it and only the rest is
   prefilled), otherwise the lowest free slot: running slots stay a run of consecutive
   ids, which llama.cpp decodes in one micro-batch (a gap splits the step in two, see
   ``backends/llamacpp.py``). When the longest prefix is held by a running slot (or a
   free slot holds it and another free slot holds less), it is copied into the lowest
   free slot: requests that arrive together with one system prompt compute it once;
3. build one batch under a token budget: every decoding slot's last sampled token first
   (decode is never starved by a long prompt), then prompt chunks of prefilling slots with
   what budget is left (chunked prefill);
4. one ``backend.forward``; sample for every slot that asked for logits, detokenize,
   check stop conditions, emit an output; finished requests free their slots and leave
   their tokens in the slot's KV for a later request that shares a prefix with them (a
   cancelled or failed request's KV is dropped at once).

The prompt cache is llama.cpp's server's (``cache_prompt`` with its slot selection by
prompt similarity): an agent's calls, each carrying the same long system prompt and the
conversation so far, prefill only what is new since a slot last held it.
"""

from __future__ import annotations

import codecs
import collections
import functools
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridllm_common import structured
from hybridllm_edge import sampling
from hybridllm_edge.backends import Backend, SlotWork

log = logging.getLogger(__name__)

# The shortest prefix worth a slot out of order (and the micro-batch split it may cost):
# below it, the lowest free slot is taken and its KV dropped.
MIN_PREFIX_TOKENS = 16


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
    num_cached_tokens: int = 0  # prompt tokens the slot's KV already held (the prompt cache)
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
    # The prompt cache's partition (the request's cache_salt, which the gateway sets to the
    # tenant): a slot's KV is reused only by a request of the same salt, so no tenant reads
    # the length of another's cached prefix from its usage.
    cache_salt: str = ""
    # --- engine-owned state below ---
    slot: int = -1
    num_cached: int = 0  # tokens already in the slot's KV
    num_prompt_cached: int = 0  # of the prompt, found in the slot's KV on admission
    output_ids: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0
    text: str = ""  # decoded completion text
    num_emitted_chars: int = 0
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace")
    )
    rng: np.random.Generator | None = None
    # Structured output: where the generated tokens stand in the request's grammar (built
    # by the server off the event loop, one per choice).
    grammar: structured.Matcher | None = None

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
        # the tokens whose KV each free slot still holds (the prompt cache)
        self._slot_tokens: list[list[int]] = [[] for _ in range(self.info.num_slots)]
        self._slot_salts: list[str] = ["" for _ in range(self.info.num_slots)]  # their owners
        self._num_waiting = 0  # in the inbox, not yet seen by the engine; under _count_lock
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._is_idle = True  # set by the engine only at the end of a loop (after releases)

    # --- other threads ----------------------------------------------------------------------

    @functools.cached_property
    def vocabulary(self) -> structured.Vocabulary:
        """The model's tokens for structured output (built at the first such request)."""
        return self.backend.grammar_vocabulary()

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

    def cached_length(self, slot: int) -> int:
        """Tokens a free slot keeps for the prompt cache (0 while a request runs in it)."""
        return len(self._slot_tokens[slot])

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
                self._finish(req, keep=False)

    def _admit(self) -> None:
        while self._free_slots and self._waiting:
            req = self._waiting.popleft()
            slot, prefix, source = self._pick_slot(req.prompt_ids, req.cache_salt)
            self._free_slots.remove(slot)
            heapq.heapify(self._free_slots)
            if source is not None:
                self.backend.copy(source, slot)
            req.slot = slot
            req.num_cached = req.num_prompt_cached = self.backend.truncate(slot, prefix)
            self._slot_tokens[slot] = []
            self._slot_salts[slot] = req.cache_salt
            if req.params.temperature > 0:
                req.rng = np.random.default_rng(req.params.seed)
            self._running.append(req)

    def _pick_slot(self, prompt: list[int], salt: str = "") -> tuple[int, int, int | None]:
        """(slot, prefix to keep, slot to copy the KV from first) for a prompt.

        The slot that holds the longest prefix, free (its tokens) or running (what it
        has computed), if that prefix reaches ``MIN_PREFIX_TOKENS``: a free one is taken
        as it is (the lowest of equals), a running one is copied into the lowest free
        slot. Otherwise the lowest empty free slot (else the lowest), emptied. Only slots of the request's own
        ``cache_salt`` count. The last prompt token is always computed again: its logits
        are the first sample's."""
        limit = len(prompt) - 1
        held = [(common_prefix(self._slot_tokens[s], prompt, limit), -s, s, True)
                for s in self._free_slots if self._slot_salts[s] == salt]  # fmt: skip
        held += [(common_prefix(r.tokens[: r.num_cached], prompt, limit), -r.slot, r.slot, False)
                 for r in self._running if r.cache_salt == salt]  # fmt: skip
        n, _, source, free = max(held, default=(0, 0, -1, True))
        # without a prefix worth keeping: the lowest empty slot, so that another prompt's
        # cache (another tenant's included) is evicted only when every free slot holds one
        lowest = min((s for s in self._free_slots if not self._slot_tokens[s]),
                     default=self._free_slots[0])  # fmt: skip
        if n < MIN_PREFIX_TOKENS:
            return lowest, 0, None
        if free:
            return source, n, None
        return lowest, n, source

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
                self._finish(req, keep=False)
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
        allowed = req.grammar.allowed() if req.grammar is not None else None
        choice = sampling.sample(logits, params, req.rng, req.output_ids, allowed)
        token = choice.token_id
        req.output_ids.append(token)
        req.logprob_sum += choice.logprob
        reason: str | None = None
        eos = token in self.info.eos_token_ids and not params.ignore_eos
        if eos or token in params.stop_token_ids:
            reason = "stop"
        else:
            req.text += req.decoder.decode(self.backend.token_bytes(token))
            if req.grammar is not None and (not req.grammar.accept(token) or req.grammar.done):
                reason = "stop"  # the grammar is complete: nothing may follow
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
                num_cached_tokens=req.num_prompt_cached,
                mean_logprob=req.logprob_sum / n_out,
                text=req.text if reason is not None else "",
            )
        )
        if reason is not None:
            self._finish(req)

    def _finish(self, req: EngineRequest, keep: bool = True) -> None:
        """Free the request's slot; ``keep``: its KV stays, as the prompt cache, for the
        tokens it computed (a cancelled or failed request's is dropped)."""
        self._running.remove(req)
        if keep:
            self._slot_tokens[req.slot] = req.tokens[: req.num_cached]
        else:
            self.backend.release(req.slot)
            self._slot_tokens[req.slot] = []
        heapq.heappush(self._free_slots, req.slot)
        req.slot = -1


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the common prefix of two token lists, at most ``limit``."""
    n = min(len(a), len(b), max(limit, 0))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
