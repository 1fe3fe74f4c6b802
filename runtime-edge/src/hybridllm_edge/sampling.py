"""Token choice from one row of logits, in numpy, with the log-probability of the choice.

Greedy (temperature 0) is ``argmax``: the same token whatever else shares the batch, which
is what makes concurrent answers equal to sequential ones. Otherwise temperature, top-k and
top-p filter the distribution and a per-request ``numpy`` generator (seeded when the request
gives a seed) draws from it. Presence and frequency penalties (OpenAI's definition) lower
the logits of tokens already generated before the choice. The reported log-probability is
always from the unmodified
distribution (what the model believes), so the mean over a completion is a comparable
confidence signal whatever the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridllm_common.structured import mask_logits

if TYPE_CHECKING:
    from hybridllm_common.structured import Constraint


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to report; None: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Structured output / tool calls: the grammar each request's tokens keep to.
    constraint: Constraint | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class Choice:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def apply_penalties(
    logits: np.ndarray, output_ids: list[int], presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's penalties: ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``,
    counted over the tokens generated so far (not the prompt)."""
    if not output_ids:
        return logits
    ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    out = logits.astype(np.float32, copy=True)
    out[ids] -= counts * np.float32(frequency) + np.float32(presence)
    return out


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator | None,
    output_ids: list[int] | None = None,
    allowed: np.ndarray | None = None,
) -> Choice:
    """logits: [vocab] float32; ``output_ids``: generated so far (for the penalties);
    ``allowed``: the tokens a grammar permits (bool[vocab]), the others never chosen."""
    logp = log_softmax(logits.astype(np.float32, copy=False))
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if params.penalized and output_ids:
        logits = apply_penalties(
            logits, output_ids, params.presence_penalty, params.frequency_penalty
        )
    if params.temperature == 0.0 or rng is None:
        token = int(np.argmax(logits))
    else:
        token = _draw(logits, params, rng)
    top_ids: list[int] = []
    top_lps: list[float] = []
    if params.logprobs:
        k = params.logprobs
        idx = np.argpartition(-logp, k)[:k]
        idx = idx[np.argsort(-logp[idx])]
        top_ids, top_lps = [int(i) for i in idx], [float(logp[i]) for i in idx]
    return Choice(token, float(logp[token]), top_ids, top_lps)


def _draw(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    scaled = logits.astype(np.float64) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if 0 < params.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, params.top_k)[: params.top_k]
    values = scaled[candidates]
    order = np.argsort(-values)
    candidates, values = candidates[order], values[order]
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(len(candidates), p=probs)])
