"""Sampling from a step's logits: greedy, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax (ties go to the lowest id, as in HF). Random rows draw with
the exponential-race trick (``argmax(p / Exp(1))`` is a sample from ``p``), one row at a
time when the request has its own generator so a seed reproduces the same text no matter
what else is in the batch. Presence and frequency penalties (OpenAI's definition, over the
tokens generated so far) lower a row's logits before the choice. Logprobs are of the
model's raw distribution (before penalties, temperature and truncation), like OpenAI and
vLLM. A structured output's grammar removes the tokens it does not allow before anything
else (the mask comes from the scheduler, one row per constrained request).

The model runner samples with ``sample``; the speculative decoding pieces (the draft
proposer, the rejection sampler) use the same steps one at a time (``processed_logits``,
``processed_probs``, ``draw``), so this module sits below ``worker/`` and
``spec_decode/`` alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridllm_cloud.outputs import TokenLogprobs
from hybridllm_cloud.sampling_params import SamplingParams


@dataclass
class SamplerResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [vocab]
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def apply_penalties(
    logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float
) -> torch.Tensor:  # [vocab]
    """``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``."""
    ids, counts = torch.unique(
        torch.tensor(output_ids, dtype=torch.int64, device=logits.device), return_counts=True
    )
    out = logits.clone()
    out[ids] -= counts.to(logits.dtype) * frequency + presence
    return out


def is_greedy(params: SamplingParams) -> bool:
    """Rows that take the argmax (``top_k == 1`` keeps only it as well)."""
    return params.greedy or params.top_k == 1


def processed_logits(
    logits: torch.Tensor, params: SamplingParams, output_ids: list[int] | None
) -> torch.Tensor:  # [vocab]
    """One row as ``sample`` sees it before choosing: penalties over ``output_ids`` applied.

    Speculative verification uses this (and ``processed_probs``) so that it judges a
    proposal against exactly the distribution the normal sampler would draw from.
    """
    if params.penalized and output_ids:
        return apply_penalties(
            logits, output_ids, params.presence_penalty, params.frequency_penalty
        )
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [vocab]
    """The distribution a random row draws from: temperature, then top-k / top-p."""
    return torch.softmax(_truncate(logits / params.temperature, params.top_k, params.top_p), -1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One sample from ``probs`` (the exponential race, as ``sample`` does)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def token_logprobs(raw_logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The model's own logprob of ``token`` and its top ``k`` (``raw_logits``: one row)."""
    lp = torch.log_softmax(raw_logits, dim=-1)
    top = torch.topk(lp, k) if k else None
    return TokenLogprobs(
        logprob=float(lp[token]),
        top_token_ids=top.indices.tolist() if top is not None else [],
        top_logprobs=top.values.tolist() if top is not None else [],
    )


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    output_ids: list[list[int] | None] | None = None,
    allowed: list[np.ndarray | None] | None = None,
) -> SamplerResult:
    """``allowed``: per row, the tokens a structured output's grammar permits (bool[vocab])
    or None; the others are never chosen. Logprobs stay the model's own."""
    raw = logits
    masked = [row for row, a in enumerate(allowed or ()) if a is not None]
    if masked:
        assert allowed is not None
        logits = logits.clone()
        rows = torch.tensor(masked, device=logits.device)
        drop = ~torch.from_numpy(np.stack([allowed[r] for r in masked])).to(logits.device)
        width = drop.shape[1]  # the grammar's vocabulary; logits may be wider (padding)
        logits[rows, :width] = logits[rows, :width].masked_fill(drop, float("-inf"))
        logits[rows, width:] = float("-inf")
    penalized = [
        row
        for row, p in enumerate(params)
        if p.penalized and output_ids is not None and output_ids[row]
    ]
    if penalized:
        logits = logits.clone() if not masked else logits
        for row in penalized:
            p = params[row]
            assert output_ids is not None
            ids = output_ids[row]
            assert ids is not None
            logits[row] = apply_penalties(logits[row], ids, p.presence_penalty, p.frequency_penalty)
    greedy = logits.argmax(dim=-1).tolist()
    token_ids: list[int] = []
    for row, p in enumerate(params):
        if p.greedy or p.top_k == 1:
            token_ids.append(greedy[row])
            continue
        scaled = _truncate(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generators[row])
        token_ids.append(int((probs / noise).argmax()))
    logprobs: list[TokenLogprobs | None] = [None] * len(params)
    want = [row for row, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for i, row in enumerate(want):
            k = params[row].logprobs or 0
            top = torch.topk(lp[i], k) if k else None
            logprobs[row] = TokenLogprobs(
                logprob=float(lp[i, token_ids[row]]),
                top_token_ids=top.indices.tolist() if top is not None else [],
                top_logprobs=top.values.tolist() if top is not None else [],
            )
    return SamplerResult(token_ids, logprobs)
