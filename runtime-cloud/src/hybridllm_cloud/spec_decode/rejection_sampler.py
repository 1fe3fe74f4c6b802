"""Verification of proposed tokens: which to keep, and the one token the target adds.

The target computed logits at the 1 + k positions of a request in one forward pass: row
``i`` is its distribution for the token after the request's tokens plus proposals
``d_1 .. d_i``. Row ``i`` is only consulted when ``d_1 .. d_i`` were all accepted, so its
penalties are computed as if they had been generated (``output_ids + d[:i]``).

- Greedy rows (temperature 0 or top-k 1): ``d_i`` is accepted while it is the argmax of
  row ``i - 1``; the first mismatch emits the argmax instead, and a fully accepted run
  adds the argmax of the last row (the "bonus" token). The output is therefore the
  tokens non-speculative greedy decoding produces, whatever was proposed.
- Random rows (Leviathan et al. 2023, Chen et al. 2023): with ``p`` the distribution the
  normal sampler would draw from (penalties, temperature, top-k, top-p) and ``q`` the
  proposal's, ``d_i`` is accepted with probability ``min(1, p(d_i) / q(d_i))``; on
  rejection the token is drawn from ``normalize(max(p - q, 0))`` and the run ends. Every
  emitted token is then distributed exactly as ``p``. An n-gram proposal is deterministic,
  so its ``q`` is one-hot: accept with probability ``p(d_i)``, else draw from ``p`` with
  ``d_i`` removed.

All random draws use the request's generator (its ``seed``), so a seeded request is
reproducible with speculation on; its tokens differ from the same seed without
speculation, since the draws are different ones (the distribution is the same).
"""

from __future__ import annotations

import torch

from hybridllm_cloud import sampler
from hybridllm_cloud.outputs import TokenLogprobs
from hybridllm_cloud.sampling_params import SamplingParams


def rejection_sample(
    target_probs: torch.Tensor,  # [k + 1, vocab]: p for each position
    draft_ids: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab]: q, or None for one-hot proposals
    generator: torch.Generator | None,
) -> list[int]:
    """The emitted tokens: the accepted prefix of ``draft_ids`` plus one drawn token."""
    out: list[int] = []
    for i, token in enumerate(draft_ids):
        p = target_probs[i]
        px = float(p[token])
        qx = 1.0 if draft_probs is None else float(draft_probs[i, token])
        u = float(torch.rand(1, generator=generator, device=p.device))
        if qx > 0.0 and u * qx < px:  # u < p/q without dividing
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i], min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: never rejected
            residual = p
        out.append(sampler.draw(residual / residual.sum(), generator))
        return out
    out.append(sampler.draw(target_probs[len(draft_ids)], generator))
    return out


def verify(
    logits: torch.Tensor,  # [k + 1, vocab] float32, the target's raw logits
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    output_ids: list[int] | None,
    generator: torch.Generator | None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Emitted tokens (``1 ..= k + 1``) and, if asked, the model's logprobs of each."""
    k = len(draft_ids)
    base = list(output_ids or [])
    rows = [sampler.processed_logits(logits[i], params, base + draft_ids[:i]) for i in range(k + 1)]
    if sampler.is_greedy(params):
        tokens: list[int] = []
        for i in range(k + 1):
            best = int(rows[i].argmax())
            tokens.append(best)
            if i == k or best != draft_ids[i]:
                break
    else:
        probs = torch.stack([sampler.processed_probs(row, params) for row in rows])
        tokens = rejection_sample(probs, draft_ids, draft_probs, generator)
    logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
    if params.logprobs is not None:
        logprobs = [
            sampler.token_logprobs(logits[i], t, params.logprobs) for i, t in enumerate(tokens)
        ]
    return tokens, logprobs
