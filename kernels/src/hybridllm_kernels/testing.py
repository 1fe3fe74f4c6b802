"""Random inputs in the engine's layouts, shared by the tests and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """A random paged KV cache holding ``context_lens`` tokens per sequence, in shuffled blocks."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, unused entries -1
    context_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    extra_table_cols: int = 1,
) -> PagedKV:
    """Blocks are handed out in a random order (tables are not contiguous), a few spare
    blocks belong to no sequence, and each table has ``extra_table_cols`` trailing -1s."""
    gen = torch.Generator().manual_seed(seed)
    # The caches are drawn on the target device: at benchmark sizes (gigabytes) a CPU draw
    # and copy would dominate the run.
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + extra_table_cols
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return PagedKV(
        k_cache,
        v_cache,
        block_tables.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
    )
