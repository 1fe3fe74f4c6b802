"""The paged KV cache as a model reads and writes it: the cache tensors, their size per
block, and the packed inputs of one forward pass over them.

The model runner (``worker/model_runner.py``) and the draft runner
(``spec_decode/draft.py``) each own a cache made here, of their own model's shape, and
both address it through the same block tables: block ``b`` of a request holds its tokens'
K/V in every cache. Both pack their sequences with ``pack``; it sits below the two of
them, next to the model whose ``AttentionMetadata`` it builds.
"""

from __future__ import annotations

import torch

from hybridllm_cloud.model import llama


def kv_bytes_per_block(model: llama.LlamaModel, block_size: int) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def allocate_kv_caches(
    model: llama.LlamaModel, num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed ``(k_cache, v_cache)`` pair per layer of ``model``."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=model.dtype, device=model.device),
            torch.zeros(shape, dtype=model.dtype, device=model.device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]


def pack(
    seqs: list[tuple[list[int], int, list[int]]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, llama.AttentionMetadata, torch.Tensor]:
    """Packs ``(token_ids, start_position, block_ids)`` sequences into one forward pass:
    input ids, positions, attention metadata and the index of each sequence's last row."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens: list[int] = []
    for token_ids, start, block_ids in seqs:
        input_ids.extend(token_ids)
        pos = range(start, start + len(token_ids))
        positions.extend(pos)
        slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in pos)
        starts.append(starts[-1] + len(token_ids))
        context_lens.append(start + len(token_ids))
    max_blocks = max(len(b) for _, _, b in seqs)
    tables = [b + [0] * (max_blocks - len(b)) for _, _, b in seqs]
    meta = llama.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        decode_only=len(input_ids) == len(seqs),
    )
    last_rows = torch.tensor([e - 1 for e in starts[1:]], dtype=torch.int64, device=device)
    return (
        torch.tensor(input_ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        meta,
        last_rows,
    )
