"""The draft-model proposer: a smaller causal LM of the same tokenizer, in the same process.

**Its KV cache** has its own tensors (the draft's layers, heads and head size) but is
indexed by the *target's* block tables: block ``b`` of a request holds the target's K/V of
its tokens in the target cache and the draft's K/V of the same tokens in the draft cache.
So the draft needs no allocator, preemption or prefix-cache logic of its own, and the
engine sizes the KV budget by the sum of both per-block sizes (``kv_bytes_per_block``).
Cache and input packing are the target's own (``model/kv_cache.py``), as is sampling
(``sampler.py``).

**What it computes, and when.** The draft runs inside the model runner's step, after the
scheduler allocated the step's blocks (its proposals write K/V there) and before the
target verifies:

1. *catch-up*: every token of the request the draft has not seen
   (``ScheduledRequest.draft_start`` on, ending with the last real token) in one packed
   forward pass; the last row's logits give ``d_1``. Catching up lazily means the draft
   never runs for prompt chunks, requests that do not speculate, or preempted work, and
   it does not rely on prefix-cache hits (a hit on the target's blocks says nothing about
   the draft's K/V, so the draft computes a request's whole history once);
2. ``k - 1`` single-token steps (``d_j`` at its position) give ``d_2 .. d_k``.

Its K/V stay valid for the real tokens it saw plus the accepted proposals it computed:
the scheduler sets ``Request.num_draft_computed`` to ``N + min(accepted, k - 1)`` (``N``:
tokens before the step), and to 0 wherever the target's blocks are dropped.

Greedy requests take the draft's argmax (``q`` is then one-hot); random ones draw from the
draft's processed distribution (temperature, top-k, top-p, no penalties: any ``q`` keeps
the output exact as long as the verifier knows it), returned for the rejection sampler.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridllm_cloud import sampler
from hybridllm_cloud.model import kv_cache, llama
from hybridllm_cloud.outputs import ScheduledRequest
from hybridllm_cloud.spec_decode.config import SpeculativeConfig, check_draft

PLACEHOLDER = -1  # proposal slots the scheduler reserved for the draft to fill


def truncated(
    model: llama.LlamaModel, num_layers: int, param: str = "speculative_draft_num_layers"
) -> llama.LlamaModel:
    """The first ``num_layers`` decoder layers of ``model`` with its embedding, final norm
    and LM head: a draft (or verifier) that shares the model's weights (no extra weight
    memory). ``param``: the setting named when ``num_layers`` is out of range."""
    if not 1 <= num_layers <= model.config.num_hidden_layers:
        raise ValueError(f"{param}: must be in [1, {model.config.num_hidden_layers}]")
    cfg = dataclasses.replace(model.config, num_hidden_layers=num_layers)
    draft = llama.LlamaModel.__new__(llama.LlamaModel)
    draft.__dict__.update(model.__dict__)
    draft.config = cfg
    draft.layers = model.layers[:num_layers]
    return draft


def load_draft(
    spec: SpeculativeConfig,
    target: llama.LlamaModel,
    dtype: torch.dtype,
    max_position: int,
    quantization: str = "none",
) -> llama.LlamaModel:
    """The draft ``spec`` names: a loaded model (optionally truncated) or the target's
    first ``draft_num_layers`` layers. Refuses one whose vocabulary differs."""
    if spec.draft_model is None:
        assert spec.draft_num_layers is not None
        check_draft(
            target.config.vocab_size,
            target.config.vocab_size,
            target.config.num_hidden_layers,
            spec.draft_num_layers,
        )
        return truncated(target, spec.draft_num_layers)
    path = Path(spec.draft_model)
    if not path.is_dir():
        import hybridllm_models

        path = Path(hybridllm_models.ensure(spec.draft_model, target="hf"))
    draft = llama.load_llama(path, dtype, target.device, max_position, quantization)
    check_draft(
        target.config.vocab_size,
        draft.config.vocab_size,
        draft.config.num_hidden_layers,
        spec.draft_num_layers,
    )
    if spec.draft_num_layers is not None:
        draft = truncated(draft, spec.draft_num_layers)
    return draft


class DraftRunner:
    def __init__(self, model: llama.LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = kv_cache.allocate_kv_caches(model, num_blocks, block_size)

    def propose(
        self, scheduled: list[ScheduledRequest], generators: list[torch.Generator | None]
    ) -> dict[str, torch.Tensor | None]:
        """Fills each record's proposal slots (``spec_token_ids`` and the tail of
        ``token_ids``) with draft tokens; returns each request's ``q`` (``[k, vocab]``), or
        None where the proposals are argmax choices (one-hot ``q``)."""
        drafts: list[list[int]] = [[] for _ in scheduled]
        probs: list[list[torch.Tensor]] = [[] for _ in scheduled]
        seqs = [(s.draft_token_ids, s.draft_start, s.block_ids) for s in scheduled]
        active = list(range(len(scheduled)))
        while active:
            ids, pos, meta, last_rows = kv_cache.pack(
                [seqs[i] for i in active], self.block_size, self.model.device
            )
            hidden = self.model.forward(ids, pos, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[last_rows])
            for row, i in enumerate(active):
                s = scheduled[i]
                token, q = self._choose(logits[row], s, generators[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(drafts[i]) < len(scheduled[i].spec_token_ids)]
            for i in active:
                s = scheduled[i]
                seqs[i] = ([drafts[i][-1]], s.start_position + len(drafts[i]), s.block_ids)
        out: dict[str, torch.Tensor | None] = {}
        for s, tokens, qs in zip(scheduled, drafts, probs, strict=True):
            k = len(s.spec_token_ids)
            s.spec_token_ids = tokens
            s.token_ids[-k:] = tokens
            out[s.request_id] = torch.stack(qs) if qs else None
        return out

    @staticmethod
    def _choose(
        logits: torch.Tensor, s: ScheduledRequest, generator: torch.Generator | None
    ) -> tuple[int, torch.Tensor | None]:
        params = s.sampling_params
        if sampler.is_greedy(params):
            return int(logits.argmax()), None
        q = sampler.processed_probs(logits, params)
        return sampler.draw(q, generator), q
