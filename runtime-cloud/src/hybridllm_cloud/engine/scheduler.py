"""The scheduler: waiting and running queues, a token budget per step, preemption.

It owns every request object and the queues; it asks the KV cache manager for blocks and
hands the model runner a plain ``SchedulerOutput``. There is no prefill/decode phase: a
request is ``num_computed_tokens`` out of ``num_tokens``, and a step gives each request
some of the gap (vLLM v1), so chunked prefill and decode share one batch.

Disaggregation uses the same scheduler in both roles:

- decode role: when a waiting request may be prefilled remotely and ``remote_prefill``
  (a callable set by the engine: threshold and prefill-pool capacity) says yes, the request
  takes blocks for its whole prompt at admission (prefix hits included, new blocks not yet
  registered), moves to ``remote`` in ``WAITING_FOR_REMOTE_KV``, and the step's output
  carries a ``KVLoad`` for the engine to start. ``finish_remote_prefill`` then makes it a
  running request with its first token; ``fail_remote_prefill`` gives its blocks back and
  puts it at the front of the queue for a local prefill. An abort while the KV is in flight
  only marks the request: its blocks are freed when the transfer has stopped writing them.
- prefill role: a request with ``kv_export`` gets a ``KVExportSlice`` per step naming the
  blocks the step completes (plus, the first time, prefix-cache hits the decode side lacks).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm_cloud.engine import block_pool, kv_cache_manager
from hybridllm_cloud.engine.beam_search import BeamGroup
from hybridllm_cloud.engine.outputs import (
    EngineCoreOutput,
    KVExportSlice,
    KVLoad,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from hybridllm_cloud.engine.request import Priority, Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # running requests at most
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    spec_draft: bool = False  # proposals come from a draft model: send it its catch-up tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: kv_cache_manager.KVCacheManager) -> None:
        self.config = config
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
        self.remote_prefill: Callable[[Request, int], bool] | None = None
        # Speculative decoding totals (vLLM's spec_decode counters).
        self.num_spec_drafts = 0  # verifications (requests x steps with proposals)
        self.num_spec_draft_tokens = 0  # proposed tokens verified
        self.num_spec_accepted_tokens = 0  # of which accepted
        # Beam search: this step's beam rows, row id -> (request id, beam index).
        self._beam_rows: dict[str, tuple[str, int]] = {}

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
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens leaves no room in a context of "
                f"{self.config.max_model_len}"
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
        self._beam_trunk(request)
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
        self._beam_trunk(victim)
        victim.num_preemptions += 1
        if victim.kv_export is not None:
            victim.kv_export.reset()
        self.num_preemptions += 1
        self.waiting[victim.priority].appendleft(victim)
        log.debug("preempted %s (recompute)", victim.request_id)
        return victim

    # --- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Spends the token budget: running requests first, then waiting ones.

        1. Running requests, in priority-then-arrival order, each get the tokens they still
           need (1 for decode, the rest of the prompt for a chunked prefill), capped by the
           remaining budget. If the pool has no block for one, the last running request
           (lowest priority, latest arrival: never one already scheduled this step) is
           preempted by recompute until it fits, or the request preempts itself.
        2. If nothing was preempted, waiting requests (interactive before batch, FIFO in a
           class) enter while budget, ``max_num_seqs`` and blocks allow; each starts after
           its longest cached prefix, and a prompt longer than the budget is chunked.
        """
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = []

        self._beam_rows = {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            group = request.beam_group
            if (
                group is not None
                and group.has_beams
                and request.num_computed_tokens >= request.num_tokens
            ):
                rows = self._schedule_beams(request, group, budget, out)
                if not rows:
                    break  # preempted itself, or its beams do not fit in this step's budget
                out.scheduled.extend(rows)
                budget -= sum(r.num_tokens for r in rows)
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new < (
                request.num_tokens - request.num_computed_tokens
            ):
                break
            num_spec = self._num_spec(request, budget)
            if num_spec and not self.kv.append_slot(request, 1 + num_spec):
                num_spec = 0  # no room for proposals: decode plainly, preempt nobody for them
            while not num_spec and not self.kv.append_slot(request, num_new):
                victim = self._preempt_last()
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # preempted itself: everything after it is gone too
            out.scheduled.append(self._record(request, num_new, num_spec))
            budget -= num_new + num_spec
            i += 1
        for running in self.running:
            running.spec_token_ids = []  # consumed (or dropped): proposed afresh next step

        while not out.preempted_req_ids and budget > 0:
            if len(self.running) + len(self.remote) >= self.config.max_num_seqs:
                break
            request = self._peek_waiting()
            if request is None:
                break
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if (
                request.allow_remote_prefill
                and self.remote_prefill is not None
                and self.remote_prefill(request, num_new)  # clears allow_remote_prefill
            ):
                if not self.kv.can_allocate(request, num_new, computed_blocks):
                    request.allow_remote_prefill = True  # decide again when blocks free up
                    break
                self._start_remote(request, num_new, computed_blocks, num_hit, out)
                continue
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            reserve = 0 if request.beam_group is None else self._beam_reserve(request)
            if not self.kv.can_allocate(request, num_new, computed_blocks, reserve):
                break
            self.kv.allocate(request, num_new, computed_blocks)
            self.waiting[request.priority].popleft()
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            bisect.insort(self.running, request, key=Request.sort_key)
            out.scheduled.append(self._record(request, num_new))
            budget -= num_new
        for scheduled in out.scheduled:
            request = self.requests.get(scheduled.request_id)  # None: a beam's row
            if request is not None and request.kv_export is not None:
                piece = self._export_slice(request, scheduled.context_len)
                if piece is not None:
                    out.kv_exports.append(piece)
        return out

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

    def _export_slice(self, request: Request, context_len: int) -> KVExportSlice | None:
        """Blocks to ship after this step: from the first not-yet-final one to the last touched."""
        export = request.kv_export
        if export is None:
            return None
        bs = self.kv.block_size
        start = export.first_block if export.sent_upto < 0 else export.sent_upto
        end = -(-context_len // bs)
        export.sent_upto = max(start, context_len // bs)
        if end <= start:
            return None
        table = self.kv.block_ids(request.request_id)
        return KVExportSlice(request.request_id, start, table[start:end])

    def _num_spec(self, request: Request, budget: int) -> int:
        """How many of the request's proposals this step verifies.

        Only a request in decode (one token missing) speculates, and never past what it
        may still emit: a step emits at most ``1 + k`` tokens, so ``k`` stays below the
        tokens ``max_tokens`` and the context leave, and within the step's budget.
        """
        if (
            not request.spec_token_ids
            or request.beam_group is not None  # beams choose among rows, not proposals
            or request.num_tokens - request.num_computed_tokens != 1
        ):
            return 0
        return max(
            0,
            min(
                len(request.spec_token_ids),
                budget - 1,
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.config.max_model_len - request.num_tokens - 1,
            ),
        )

    def _record(self, request: Request, num_new: int, num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        spec = request.spec_token_ids[:num_spec]
        sample = start + num_new == request.num_tokens
        params = request.sampling_params
        if request.beam_group is not None:  # the prompt (trunk) of a beam search
            sample = sample and not request.beam_group.has_beams  # not when resuming
            params = request.beam_group.row_params
        record = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_new) + spec,
            start_position=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=sample,
            sampling_params=params,
            num_output_tokens=request.num_output_tokens,
            output_token_ids=(
                list(request.output_token_ids) if request.sampling_params.penalized else None
            ),
            spec_token_ids=spec,
            allowed_tokens=(
                request.grammar.allowed() if sample and request.grammar is not None else None
            ),
        )
        if params.prompt_logprobs is not None and not request.output_token_ids:
            self._prompt_targets(request, record)
        if spec and self.config.spec_draft:
            record.draft_start = min(request.num_draft_computed, start)
            record.draft_token_ids = request.token_slice(record.draft_start, start + 1)
        return record

    @staticmethod
    def _prompt_targets(request: Request, record: ScheduledRequest) -> None:
        """Row j of the chunk (position start + j) predicts the prompt token after it."""
        first = max(record.start_position, request.sampling_params.prompt_logprobs_start - 1)
        end = min(record.context_len, request.num_prompt_tokens - 1)  # exclusive, positions
        if first < end:
            record.prompt_row = first - record.start_position
            record.prompt_targets = request.prompt_token_ids[first + 1 : end + 1]

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advances computed tokens, appends sampled ones, finishes stopped requests."""
        outputs: list[EngineCoreOutput] = []
        beam_rows: dict[str, list[TokenLogprobs]] = {}
        for scheduled in sched.scheduled:
            beam_row = self._beam_rows.get(scheduled.request_id)
            if beam_row is not None:
                self._advance_beam(beam_row, scheduled, result, beam_rows)
                continue
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if scheduled.prompt_targets:
                self._store_prompt_logprobs(request, scheduled, result)
            num_spec = len(scheduled.spec_token_ids)
            if num_spec:
                tokens = result.spec_token_ids[scheduled.request_id]
                logprobs = result.spec_logprobs.get(scheduled.request_id, [])
                self._account_spec(request, scheduled, len(tokens) - 1)
            else:
                request.num_computed_tokens += scheduled.num_tokens
                if request.beam_group is not None:
                    lp = result.logprobs.get(scheduled.request_id)
                    if lp is not None:  # the prompt's end: the first beam step
                        beam_rows[request.request_id] = [lp]
                    continue
                token = result.sampled_token_ids.get(scheduled.request_id)
                if token is None:
                    continue
                tokens = [token]
                one = result.logprobs.get(scheduled.request_id)
                logprobs = [one] if one else []
            status = None
            emitted = 0
            first_output = not request.output_token_ids
            for token in tokens:  # an EOS, stop id or max_tokens ends the run there
                request.output_token_ids.append(token)
                emitted += 1
                status = self._check_stop(request, token)
                if status is None and request.grammar is not None:
                    status = self._check_grammar(request, token)
                if status is not None:
                    break
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=tokens[:emitted],
                    finish_reason=status.value if status else None,
                    stop_reason=request.stop_reason,
                    logprobs=logprobs[:emitted],
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=(
                        request.prompt_logprobs
                        if first_output and request.sampling_params.prompt_logprobs is not None
                        else None
                    ),
                )
            )
            if status is not None:
                self.running.remove(request)
                request.status = status
                self._free(request)
            elif num_spec:
                self.kv.trim(request)
        for request_id, rows in beam_rows.items():
            core = self._beam_step(self.requests[request_id], rows)
            if core is not None:
                outputs.append(core)
        return outputs

    @staticmethod
    def _store_prompt_logprobs(
        request: Request, scheduled: ScheduledRequest, result: ModelRunnerOutput
    ) -> None:
        """Keeps them by position: a chunk computed again (after a preemption) overwrites."""
        start = request.sampling_params.prompt_logprobs_start
        first = scheduled.start_position + scheduled.prompt_row + 1  # of prompt_targets[0]
        del request.prompt_logprobs[first - start :]
        request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])

    def _account_spec(self, request: Request, scheduled: ScheduledRequest, accepted: int) -> None:
        """Advances past the accepted proposals only: the K/V written for rejected ones
        lie beyond ``num_computed_tokens``, where nothing reads them and the next step
        overwrites them (``kv.trim`` then gives back blocks that hold nothing else)."""
        num_spec = len(scheduled.spec_token_ids)
        num_tokens_before = request.num_tokens
        request.num_computed_tokens += scheduled.num_tokens - num_spec + accepted
        if self.config.spec_draft:
            request.num_draft_computed = num_tokens_before + min(accepted, num_spec - 1)
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_spec
        self.num_spec_accepted_tokens += accepted

    # --- beam search (engine/beam_search.py): a group of beams as one request ----------------

    def _schedule_beams(
        self, request: Request, group: BeamGroup, budget: int, out: SchedulerOutput
    ) -> list[ScheduledRequest]:
        """One row per beam; preempts (whole requests, from the back) until the blocks fit."""
        pool, bs = self.kv.pool, self.kv.block_size
        if group.tables is None:  # the trunk (prompt) is computed: fork the beams from it
            group.fork(self.kv.take_blocks(request), request.num_tokens, pool)
        plan = group.plan(budget, self.config.enable_chunked_prefill)
        if plan is None:
            return []
        while group.blocks_needed(plan, bs) > pool.num_free_blocks:
            victim = self._preempt_last()
            out.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return []
        out.block_copies.extend(group.allocate(plan, pool, bs))
        rows = group.records(request.request_id, request.prompt_token_ids, plan)
        for beam, row in rows:
            self._beam_rows[row.request_id] = (request.request_id, beam)
        return [row for _, row in rows]

    def _beam_reserve(self, request: Request) -> int:
        """Blocks a beam group needs beyond its prompt's soon after admission.

        A fresh group needs one block per beam when the beams first diverge; a preempted one
        recomputes every beam's tokens, so it is admitted only when they all fit too.
        """
        group = request.beam_group
        assert group is not None
        bs = self.kv.block_size
        if not group.has_beams:
            return group.width
        per_beam = -(-group.seq_len // bs) - request.num_tokens // bs
        return per_beam * len(group.running)

    @staticmethod
    def _beam_trunk(request: Request) -> None:
        """After a preemption a beam group recomputes prompt + common prefix as one trunk."""
        if request.beam_group is not None:
            request.output_token_ids = request.beam_group.common_prefix()

    def _advance_beam(
        self,
        beam_row: tuple[str, int],
        scheduled: ScheduledRequest,
        result: ModelRunnerOutput,
        beam_rows: dict[str, list[TokenLogprobs]],
    ) -> None:
        request_id, beam = beam_row
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return
        assert request.beam_group is not None
        request.beam_group.advance(beam, scheduled.num_tokens)
        lp = result.logprobs.get(scheduled.request_id)
        if lp is not None:
            beam_rows.setdefault(request_id, []).append(lp)

    def _beam_step(self, request: Request, rows: list[TokenLogprobs]) -> EngineCoreOutput | None:
        """Selects the next beams; a finished search returns its sequences, best first."""
        group = request.beam_group
        assert group is not None
        group.step(rows, self.kv.pool)
        if not group.done:
            return None
        results = group.results()
        best = results[0]
        status = (
            RequestStatus.FINISHED_STOPPED
            if best.finish_reason == "stop"
            else RequestStatus.FINISHED_LENGTH
        )
        self.running.remove(request)
        request.status = status
        request.output_token_ids = list(best.token_ids)
        self._free(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(best.token_ids),
            finish_reason=status.value,
            stop_reason=best.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            beams=results,
            beam_kv=group.stats,
        )

    @staticmethod
    def _check_grammar(request: Request, token: int) -> RequestStatus | None:
        """Structured output: the sequence ends where its grammar is complete (it can take
        nothing more), or where it refused a token (only possible when no allowed token
        was left to sample, e.g. all of them masked by a stop id: then it stops)."""
        assert request.grammar is not None
        if not request.grammar.accept(token) or request.grammar.done:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
