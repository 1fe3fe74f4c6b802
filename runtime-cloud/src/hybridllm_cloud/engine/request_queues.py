"""The scheduler's requests and where each one is: its queues, and the moves between them.

``RequestQueues`` (the base of ``scheduler.Scheduler``, which adds the step) owns every
request object: the waiting queues (one per priority, FIFO), the running list (sorted by
``Request.sort_key``), the requests held out of the schedule while a failed step is
isolated, and, in the decode role, the requests whose prompt KV a prefill worker is
filling. Here a request is added, finished from outside the step (abort, stop string),
preempted by recompute, held and released.

Decode role: when a waiting request may be prefilled remotely and the scheduler's
``remote_prefill`` (a callable set by the engine: threshold and prefill-pool capacity) says
yes, the request takes blocks for its whole prompt at admission (prefix hits included, new
blocks not yet registered), moves to ``remote`` in ``WAITING_FOR_REMOTE_KV``, and the
step's output carries a ``KVLoad`` for the engine to start (``_start_remote``).
``finish_remote_prefill`` then makes it a running request with its first token;
``fail_remote_prefill`` gives its blocks back and puts it at the front of the queue for a
local prefill. An abort while the KV is in flight only marks the request: its blocks are
freed when the transfer has stopped writing them.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

from hybridllm_cloud.engine import block_pool, kv_cache_manager
from hybridllm_cloud.engine.beam_scheduler import beam_trunk
from hybridllm_cloud.engine.request import Priority, Request, RequestStatus
from hybridllm_cloud.outputs import EngineCoreOutput, KVLoad, SchedulerOutput, TokenLogprobs

log = logging.getLogger(__name__)


class RequestQueues:
    """Every request of the scheduler, by id and by queue (see the module docstring)."""

    def __init__(self, max_model_len: int, kv: kv_cache_manager.KVCacheManager) -> None:
        self.max_model_len = max_model_len
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: dict[Priority, deque[Request]] = {p: deque() for p in Priority}
        self.running: list[Request] = []  # kept sorted by Request.sort_key
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        # Decode role: requests whose prompt KV a prefill worker is filling.
        self.remote: dict[str, Request] = {}
        # Out of the schedule while a failed step is isolated (see AsyncEngine), no blocks.
        self.held: dict[str, Request] = {}

    # --- queues ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0 or bool(self.remote) or bool(self.held)

    def has_schedulable(self) -> bool:
        """Work a step can do now (requests waiting for remote KV cannot run yet)."""
        return bool(self.running) or self.num_waiting > 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room in a context of "
                f"{self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting[request.priority].append(request)

    def _peek_waiting(self) -> Request | None:
        for priority in Priority:
            if self.waiting[priority]:
                return self.waiting[priority][0]
        return None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Ends requests from outside the step (abort, stop string); frees their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                # A transfer may still be writing its blocks: they are freed when it ends.
                request.status = status
                del self.requests[request_id]
                continue
            if request_id in self.held:
                del self.held[request_id]
            elif request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting[request.priority].remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_step.append(request.request_id)

    # --- isolation of a failed step -------------------------------------------------------

    def hold(self, request_id: str, drop_cached: bool = False) -> bool:
        """Take a running or waiting request out of the schedule, to recompute when released.

        Like a preemption: its blocks are freed and its generated tokens kept. With
        ``drop_cached`` its blocks also leave the prefix cache: after a failed step their K/V
        may be half-written (blocks are registered when scheduled, before the step runs).
        """
        request = self.requests.get(request_id)
        if request is None or request_id in self.held or request_id in self.remote:
            return False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting[request.priority]:
            self.waiting[request.priority].remove(request)
        else:
            return False
        self.kv.free(request, drop_cached=drop_cached)
        request.status = RequestStatus.PREEMPTED
        request.reset_computed()
        beam_trunk(request)
        if request.kv_export is not None:
            request.kv_export.reset()
        self.held[request_id] = request
        return True

    def hold_running(self, drop_cached: bool) -> list[str]:
        """Every running request out of the schedule (see ``hold``); their ids."""
        ids = [r.request_id for r in self.running]
        for request_id in ids:
            self.hold(request_id, drop_cached=drop_cached)
        return ids

    def release(self, request_id: str) -> bool:
        """Back to the front of its waiting queue."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.waiting[request.priority].appendleft(request)
        return True

    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.reset_computed()
        beam_trunk(victim)
        victim.num_preemptions += 1
        if victim.kv_export is not None:
            victim.kv_export.reset()
        self.num_preemptions += 1
        self.waiting[victim.priority].appendleft(victim)
        log.debug("preempted %s (recompute)", victim.request_id)
        return victim

    # --- decode role: remote prefills ----------------------------------------------------

    def _start_remote(
        self,
        request: Request,
        num_new: int,
        computed_blocks: list[block_pool.KVBlock],
        num_hit: int,
        out: SchedulerOutput,
    ) -> None:
        self.kv.allocate(request, num_new, computed_blocks, register=False)
        self.waiting[request.priority].popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self.remote[request.request_id] = request
        out.kv_loads.append(
            KVLoad(
                request_id=request.request_id,
                prompt_token_ids=request.all_token_ids(),
                block_ids=self.kv.block_ids(request.request_id),
                first_block=len(computed_blocks),
                sampling_params=request.sampling_params,
            )
        )

    def finish_remote_prefill(
        self, request_id: str, token: int, logprobs: TokenLogprobs | None
    ) -> EngineCoreOutput | None:
        """The prompt's KV arrived: the request runs on, with its first token.

        Returns None when the request was aborted meanwhile (its blocks are freed now).
        """
        request = self.remote.pop(request_id)
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            self.kv.free(request)
            self._finished_since_step.append(request_id)
            return None
        request.num_computed_tokens = request.num_tokens
        self.kv.register_computed(request)
        request.output_token_ids.append(token)
        status = self._check_stop(request, token)
        if status is None:
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
        else:
            request.status = status
            self._free(request)
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[token],
            finish_reason=status.value if status else None,
            stop_reason=request.stop_reason,
            logprobs=[logprobs] if logprobs else [],
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def fail_remote_prefill(self, request_id: str) -> None:
        """The transfer failed for good: give the blocks back and prefill locally."""
        request = self.remote.pop(request_id)
        self.kv.free(request)
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            self._finished_since_step.append(request_id)
            return
        request.reset_computed()
        request.allow_remote_prefill = False
        request.status = RequestStatus.WAITING
        self.waiting[request.priority].appendleft(request)

    # --- stopping -------------------------------------------------------------------------

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Whether the token just appended ends the request: EOS, a stop token id,
        ``max_tokens`` or the context (also each token of a step's, in ``Scheduler``)."""
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
