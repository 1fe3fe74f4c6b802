"""Speculative decoding in the engine and its scheduler; the proposers, the draft model's
runner and the rejection sampler are in ``spec_decode/``.

- ``propose`` (the engine, before each schedule): proposals for every running request in
  decode: n-gram ones made here, on the full token history, or ``k`` reserved slots a
  draft model fills in the runner once the step is scheduled.
- ``num_spec`` (the scheduler, per request): how many of its proposals a step verifies.
- ``accept`` (the scheduler, after the step): the request advances past the accepted
  proposals only; the scheduler counts drafts, draft tokens and accepted tokens (vLLM's
  spec_decode counters).
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridllm_cloud.engine.request import Request
from hybridllm_cloud.outputs import ScheduledRequest
from hybridllm_cloud.spec_decode import draft as draft_mod
from hybridllm_cloud.spec_decode import ngram
from hybridllm_cloud.spec_decode.config import SpeculativeConfig


def propose(running: Iterable[Request], spec: SpeculativeConfig) -> None:
    """Speculative decoding: proposals for every running request in decode.

    n-gram proposals are made here, on the full token history; a draft model's are
    made in the runner once the step is scheduled, so here its ``k`` slots are only
    reserved (the scheduler trims them to what the request may still emit).
    """
    k = spec.num_speculative_tokens
    for request in running:
        if request.num_tokens - request.num_computed_tokens != 1 or request.beam_group:
            continue  # mid-prefill, or a beam search (its rows are the choices)
        if request.grammar is not None:
            # Structured output is not speculated: a proposal would need the grammar's
            # mask at every proposed position (llguidance can, per draft token), and
            # the drafts of a constrained answer are mostly forced tokens anyway.
            continue
        if spec.method == "ngram":
            request.spec_token_ids = ngram.propose(
                request.all_token_ids(), k, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
        else:
            request.spec_token_ids = [draft_mod.PLACEHOLDER] * k


def num_spec(request: Request, budget: int, max_model_len: int) -> int:
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
            max_model_len - request.num_tokens - 1,
        ),
    )


def accept(request: Request, scheduled: ScheduledRequest, accepted: int, draft: bool) -> None:
    """Advances past the accepted proposals only: the K/V written for rejected ones
    lie beyond ``num_computed_tokens``, where nothing reads them and the next step
    overwrites them (``kv.trim`` then gives back blocks that hold nothing else).
    ``draft``: the proposals came from a draft model, whose computed length
    (``num_draft_computed``) moves too."""
    num_spec = len(scheduled.spec_token_ids)
    num_tokens_before = request.num_tokens
    request.num_computed_tokens += scheduled.num_tokens - num_spec + accepted
    if draft:
        request.num_draft_computed = num_tokens_before + min(accepted, num_spec - 1)
