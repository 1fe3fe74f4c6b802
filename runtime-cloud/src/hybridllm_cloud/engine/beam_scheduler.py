"""Beam search in the scheduler: a group of beams as one request (``beam_search.BeamGroup``).

The scheduler sees one request per beam search. Until its prompt (the *trunk*) is
computed it is scheduled like any other; then ``BeamScheduling.schedule`` forks the beams
from the trunk's blocks and gives the step one row per beam, preempting whole requests
from the back of the running list until the beams' blocks fit. After the step,
``advance`` collects each row's logprobs and ``step`` selects the next beams; a finished
search ends its request with every returned sequence, best first. A preempted group
recomputes prompt + common prefix as one trunk (``beam_trunk``).
"""

from __future__ import annotations

from collections.abc import Callable

from hybridllm_cloud.engine import kv_cache_manager
from hybridllm_cloud.engine.beam_search import BeamGroup
from hybridllm_cloud.engine.request import Request, RequestStatus
from hybridllm_cloud.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)


def beam_trunk(request: Request) -> None:
    """After a preemption a beam group recomputes prompt + common prefix as one trunk."""
    if request.beam_group is not None:
        request.output_token_ids = request.beam_group.common_prefix()


class BeamScheduling:
    """The scheduler's beam searches. ``requests`` and ``running`` are the scheduler's own
    (shared, never replaced); ``preempt`` preempts its last running request, ``free`` frees
    the blocks of a request that has left the queues."""

    def __init__(
        self,
        kv: kv_cache_manager.KVCacheManager,
        requests: dict[str, Request],
        running: list[Request],
        preempt: Callable[[], Request],
        free: Callable[[Request], None],
        enable_chunked_prefill: bool,
    ) -> None:
        self.kv = kv
        self.requests = requests
        self.running = running
        self.preempt = preempt
        self.free = free
        self.enable_chunked_prefill = enable_chunked_prefill
        # This step's beam rows, row id -> (request id, beam index).
        self.rows: dict[str, tuple[str, int]] = {}

    def schedule(
        self, request: Request, group: BeamGroup, budget: int, out: SchedulerOutput
    ) -> list[ScheduledRequest]:
        """One row per beam; preempts (whole requests, from the back) until the blocks fit."""
        pool, bs = self.kv.pool, self.kv.block_size
        if group.tables is None:  # the trunk (prompt) is computed: fork the beams from it
            group.fork(self.kv.take_blocks(request), request.num_tokens, pool)
        plan = group.plan(budget, self.enable_chunked_prefill)
        if plan is None:
            return []
        while group.blocks_needed(plan, bs) > pool.num_free_blocks:
            victim = self.preempt()
            out.preempted_req_ids.append(victim.request_id)
            if victim is request:
                return []
        out.block_copies.extend(group.allocate(plan, pool, bs))
        rows = group.records(request.request_id, request.prompt_token_ids, plan)
        for beam, row in rows:
            self.rows[row.request_id] = (request.request_id, beam)
        return [row for _, row in rows]

    def reserve(self, request: Request) -> int:
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

    def advance(
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

    def step(self, request: Request, rows: list[TokenLogprobs]) -> EngineCoreOutput | None:
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
        self.free(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=list(best.token_ids),
            finish_reason=status.value,
            stop_reason=best.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            beams=results,
            beam_kv=group.stats,
        )
