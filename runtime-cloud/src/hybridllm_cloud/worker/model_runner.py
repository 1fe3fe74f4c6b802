"""The model runner: one forward pass over every scheduled token of a step, then sampling.

It owns the KV cache tensors (one ``k_cache``/``v_cache`` pair per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]``) and per-request generators; it sees
requests only as ``ScheduledRequest`` records. Inputs are packed: all new tokens of all
scheduled requests form one ``[num_tokens]`` batch; per sequence, ``query_start_loc``,
``context_lens`` and its block table give attention its view of the cache. When every
sequence brings a single token (pure decode), the decode kernel runs instead of the
varlen prefill one. The cache and the packing are ``model/kv_cache.py``'s (the draft
model's runner uses them too); sampling is ``sampler.py``'s, verification of proposals
``spec_decode/rejection_sampler.py``'s.

For disaggregation the runner is also where KV blocks leave and enter the cache:
``kv_export_sink`` receives, after each layer of a step, copies of the blocks the
scheduler named in ``kv_exports`` (prefill role), and ``write_blocks`` stores blocks that
arrived from a prefill worker (decode role; called from the transfer thread, on blocks no
running request reads). A request's random generator state can be exported after its
first token and imported on the other side, so seeded sampling continues unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridllm_cloud import sampler
from hybridllm_cloud.model import kv_cache, llama
from hybridllm_cloud.outputs import (
    KVExportSlice,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from hybridllm_cloud.spec_decode import rejection_sampler

if TYPE_CHECKING:
    from hybridllm_cloud.spec_decode.draft import DraftRunner

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: llama.LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = kv_cache.allocate_kv_caches(model, num_blocks, block_size)
        self.req_to_generator: dict[str, torch.Generator] = {}
        # Speculative decoding with a draft model: proposes into its own cache (same blocks).
        self.drafter: DraftRunner | None = None
        # (request_id, layer, first_block, k_blocks, v_blocks) -> None
        self.kv_export_sink: Callable[[str, int, int, torch.Tensor, torch.Tensor], None] | None = (
            None
        )

    # --- KV blocks in and out (disaggregation) ------------------------------------------

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.kv_caches[0][0].shape[1:])

    def _layer_hook(self, exports: list[KVExportSlice]) -> Callable[[int], None] | None:
        sink = self.kv_export_sink
        if sink is None or not exports:
            return None
        dev = self.model.device
        index = [torch.tensor(e.block_ids, dtype=torch.int64, device=dev) for e in exports]

        def hook(layer: int) -> None:
            k_cache, v_cache = self.kv_caches[layer]
            for export, idx in zip(exports, index, strict=True):
                sink(
                    export.request_id,
                    layer,
                    export.first_block,
                    k_cache.index_select(0, idx),
                    v_cache.index_select(0, idx),
                )

        return hook

    def write_blocks(
        self, layer_start: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Stores ``k``/``v`` of shape ``[layers, len(block_ids), *block_shape]``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.model.device)
        for offset in range(k.shape[0]):
            k_cache, v_cache = self.kv_caches[layer_start + offset]
            k_cache.index_copy_(0, idx, k[offset].to(k_cache.device, non_blocking=True))
            v_cache.index_copy_(0, idx, v[offset].to(v_cache.device, non_blocking=True))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Beam search copy on write: block ``dst`` becomes a copy of ``src`` in every layer."""
        dev = self.model.device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dev)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def generator_state(self, request_id: str) -> torch.Tensor | None:
        gen = self.req_to_generator.get(request_id)
        return gen.get_state() if gen is not None else None

    def set_generator_state(self, request_id: str, state: torch.Tensor) -> None:
        gen = torch.Generator(device=self.model.device)
        gen.set_state(state)
        self.req_to_generator[request_id] = gen

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.req_to_generator.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.model.device).manual_seed(seed)
            self.req_to_generator[request_id] = gen
        return gen

    def _prompt_logprobs(
        self,
        sched: SchedulerOutput,
        hidden: torch.Tensor,
        last_rows: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """The logprob (and top k) of each prompt token a scheduled chunk predicts."""
        ends = last_rows.tolist()
        for i, s in enumerate(sched.scheduled):
            if not s.prompt_targets:
                continue
            first = ends[i] - s.num_tokens + 1 + s.prompt_row
            n = len(s.prompt_targets)
            lp = torch.log_softmax(self.model.compute_logits(hidden[first : first + n]), dim=-1)
            targets = torch.tensor(s.prompt_targets, device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
            k = s.sampling_params.prompt_logprobs or 0
            top = torch.topk(lp, k, dim=-1) if k else None
            out.prompt_logprobs[s.request_id] = [
                TokenLogprobs(
                    logprob=chosen[j],
                    top_token_ids=top.indices[j].tolist() if top is not None else [],
                    top_logprobs=top.values[j].tolist() if top is not None else [],
                )
                for j in range(n)
            ]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step's forward pass and samples; requests with proposals
        (``spec_token_ids``) are verified by the rejection sampler instead, from the
        target's logits at all their 1 + k positions."""
        for request_id in sched.finished_req_ids:
            self.req_to_generator.pop(request_id, None)
        if sched.block_copies:
            self.copy_blocks(sched.block_copies)
        if sched.is_empty:
            return ModelRunnerOutput()
        spec = [s for s in sched.scheduled if s.spec_token_ids]
        draft_probs: dict[str, torch.Tensor | None] = {}
        if spec and self.drafter is not None:
            draft_probs = self.drafter.propose(
                spec, [self._generator(s.request_id, s.sampling_params.seed) for s in spec]
            )
        dev = self.model.device
        input_ids, positions, meta, last_rows = kv_cache.pack(
            [(s.token_ids, s.start_position, s.block_ids) for s in sched.scheduled],
            self.block_size,
            dev,
        )
        hidden = self.model.forward(
            input_ids, positions, self.kv_caches, meta, self._layer_hook(sched.kv_exports)
        )
        out = ModelRunnerOutput()
        self._prompt_logprobs(sched, hidden, last_rows, out)
        logits_rows: list[int] = []
        sampled = []
        verified: list[tuple[int, int]] = []  # (index in sched.scheduled, first logits row)
        ends = last_rows.tolist()
        for i, s in enumerate(sched.scheduled):
            if not s.sample:
                continue
            k = len(s.spec_token_ids)
            if k:
                verified.append((i, len(logits_rows)))
                logits_rows.extend(range(ends[i] - k, ends[i] + 1))
            else:
                sampled.append((s, len(logits_rows)))
                logits_rows.append(ends[i])
        if not logits_rows:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=dev)])
        if sampled:
            plain = [s for s, _ in sampled]
            rows = logits if not verified else logits[[r for _, r in sampled]]
            result = sampler.sample(
                rows,
                [s.sampling_params for s in plain],
                [self._generator(s.request_id, s.sampling_params.seed) for s in plain],
                [s.output_token_ids for s in plain],
                [s.allowed_tokens for s in plain],
            )
            for s, token, lp in zip(plain, result.token_ids, result.logprobs, strict=True):
                out.sampled_token_ids[s.request_id] = token
                if lp is not None:
                    out.logprobs[s.request_id] = lp
        for i, row in verified:
            s = sched.scheduled[i]
            k = len(s.spec_token_ids)
            tokens, lps = rejection_sampler.verify(
                logits[row : row + k + 1],
                s.spec_token_ids,
                draft_probs.get(s.request_id),
                s.sampling_params,
                s.output_token_ids,
                self._generator(s.request_id, s.sampling_params.seed),
            )
            out.spec_token_ids[s.request_id] = tokens
            if s.sampling_params.logprobs is not None:
                out.spec_logprobs[s.request_id] = [lp for lp in lps if lp is not None]
        return out
