"""The scheduler: waiting and running queues, a token budget per step, preemption.

It owns every request object and the queues; it asks the KV cache manager for blocks and
hands the model runner a plain ``SchedulerOutput``. There is no prefill/decode phase: a
request is ``num_computed_tokens`` out of ``num_tokens``, and a step gives each request
some of the gap (vLLM v1), so chunked prefill and decode share one batch.

Disaggregation uses the same scheduler in both roles:

- decode role: a waiting request that a prefill worker may prefill (``remote_prefill``, a
  callable set by the engine, says yes) takes blocks for its whole prompt at admission and
  waits in ``remote`` while the engine's ``KVLoad`` fills them (``request_queues.py``).
- prefill role: a request with ``kv_export`` gets a ``KVExportSlice`` per step naming the
  blocks the step completes (plus, the first time, prefix-cache hits the decode side lacks).

Where each part lives:

- here: ``Scheduler``, the step: ``schedule`` (spending the budget) and
  ``update_from_output`` (advancing the requests by the step's tokens);
- ``request_queues.py``: ``RequestQueues``, its base: every request and the queues, adding
  and finishing requests, preemption, holding requests out of the schedule while a failed
  step is isolated, and the decode role's remote prefills;
- ``beam_scheduler.py``: ``BeamScheduling``, a beam search's rows and beam selection;
- ``speculation.py``: how many proposals a step verifies, and how far the accepted ones
  advance a request.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from hybridllm_cloud.engine import kv_cache_manager, speculation
from hybridllm_cloud.engine.beam_scheduler import BeamScheduling
from hybridllm_cloud.engine.request import Request, RequestStatus
from hybridllm_cloud.engine.request_queues import RequestQueues
from hybridllm_cloud.outputs import (
    EngineCoreOutput,
    KVExportSlice,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from hybridllm_common import structured


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # running requests at most
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    spec_draft: bool = False  # proposals come from a draft model: send it its catch-up tokens


class Scheduler(RequestQueues):
    """The step over the queues of ``RequestQueues`` (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, kv: kv_cache_manager.KVCacheManager) -> None:
        super().__init__(config.max_model_len, kv)
        self.config = config
        self.remote_prefill: Callable[[Request, int], bool] | None = None
        # Speculative decoding totals (vLLM's spec_decode counters).
        self.num_spec_drafts = 0  # verifications (requests x steps with proposals)
        self.num_spec_draft_tokens = 0  # proposed tokens verified
        self.num_spec_accepted_tokens = 0  # of which accepted
        # Beam search: the beam rows of this step, and the selection after it.
        self.beams = BeamScheduling(
            kv,
            self.requests,
            self.running,
            self._preempt_last,
            self._free,
            config.enable_chunked_prefill,
        )
        # This step's rows with a grammar: their masks are made together (``schedule``).
        self._constrained: list[tuple[ScheduledRequest, structured.Matcher]] = []

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
        self._constrained = []  # this step's only, even after a step that raised
        out = SchedulerOutput(finished_req_ids=self._finished_since_step)
        self._finished_since_step = []

        self.beams.rows = {}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            group = request.beam_group
            if (
                group is not None
                and group.has_beams
                and request.num_computed_tokens >= request.num_tokens
            ):
                rows = self.beams.schedule(request, group, budget, out)
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
            num_spec = speculation.num_spec(request, budget, self.config.max_model_len)
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
            reserve = 0 if request.beam_group is None else self.beams.reserve(request)
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
        if self._constrained:  # every structured row's next-token mask, in one batch
            masks = structured.allowed_batch([g for _, g in self._constrained])
            for (record, _), mask in zip(self._constrained, masks, strict=True):
                record.allowed_tokens = mask
            self._constrained = []
        for scheduled in out.scheduled:
            request = self.requests.get(scheduled.request_id)  # None: a beam's row
            if request is not None and request.kv_export is not None:
                piece = self._export_slice(request, scheduled.context_len)
                if piece is not None:
                    out.kv_exports.append(piece)
        return out

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
        )
        if sample and request.grammar is not None:  # its mask: with the others', at the end
            self._constrained.append((record, request.grammar))
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
            beam_row = self.beams.rows.get(scheduled.request_id)
            if beam_row is not None:
                self.beams.advance(beam_row, scheduled, result, beam_rows)
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
            core = self.beams.step(self.requests[request_id], rows)
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
        """``speculation.accept`` advances the request; vLLM's spec_decode counters."""
        speculation.accept(request, scheduled, accepted, self.config.spec_draft)
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(scheduled.spec_token_ids)
        self.num_spec_accepted_tokens += accepted

    @staticmethod
    def _check_grammar(request: Request, token: int) -> RequestStatus | None:
        """Structured output: the sequence ends where its grammar is complete (it can take
        nothing more), or where it refused a token (only possible when no allowed token
        was left to sample, e.g. all of them masked by a stop id: then it stops)."""
        assert request.grammar is not None
        if not request.grammar.accept(token) or request.grammar.done:
            return RequestStatus.FINISHED_STOPPED
        return None
