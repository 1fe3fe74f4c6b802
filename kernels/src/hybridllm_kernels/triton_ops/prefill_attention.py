"""Paged prefill / extend attention: chunks of new query tokens over cached prefix + themselves.

This is what chunked prefill and prefix-cache hits need: a sequence's new tokens sit at the
end of its context (their K/V already written to the cache), and token ``i`` of the chunk,
at position ``context_len - q_len + i``, sees every key at or before its own position.

Organisation (after vLLM's Triton unified attention; our own code):

- Queries are packed (varlen, ``query_start_loc``). Programs cover blocks of ``BLOCK_Q``
  query tokens of one sequence and one KV head; the launch grid is an upper bound
  (``num_tokens // BLOCK_Q + num_seqs`` blocks), and each program finds its sequence by a
  binary search over ``query_start_loc``, so nothing is read back to the host.
- A program's rows are (token, query head of the GQA group) pairs, ``BLOCK_M`` of them, so
  the group's heads share every K/V tile they load.
- Every key, prefix or new, is read from the paged cache through the block table; the key
  loop stops at the block's last causal position and, with a sliding window, starts at the
  first position the window can see. Online softmax in base 2, as in decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridllm_kernels.triton_ops._common import LOG2E, dot, dot_flags


@triton.jit
def _find_seq(query_start_loc_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    # Loop-carried bounds typed int32 up front (as vLLM's find_seq_idx does), so they keep
    # one type through the loop.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    sliding_window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = (block_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_tok >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (tok < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    q_ptrs = (
        q_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_qt
        + heads[:, None] * stride_qh
        + d[None, :]
    )
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D]
    # Padding rows take the last valid token's position, so every row sees >= 1 key.
    q_pos = prefix_len + tl.minimum(tok, q_len - 1)

    last_tok = tl.minimum(first_tok + BLOCK_Q, q_len) - 1
    hi = prefix_len + last_tok + 1
    # Keys before the first one the block's earliest token can see are never loaded: with
    # a sliding window their blocks may have been freed.
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(prefix_len + first_tok - sliding_window + 1, 0)
    lo = (first_key // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(lo, hi, TILE_N):
        offs = tile_start + tl.arange(0, TILE_N)
        k_valid = (offs < hi) & (offs >= first_key)
        block_ids = tl.load(table + offs // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_offs = offs % BLOCK_SIZE
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k_ptrs = (
            k_cache_ptr
            + block_ids[:, None] * stride_kb
            + slot_offs[:, None] * stride_ko
            + kv_head * stride_kh
            + d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [TILE_N, D]
        scores = dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * scale_log2
        visible = k_valid[None, :] & (offs[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, TILE_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = (
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + slot_offs[:, None] * stride_vo
            + kv_head * stride_vh
            + d[None, :]
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]
    out_ptrs = (
        out_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_ot
        + heads[:, None] * stride_oh
        + d[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_prefill_attention needs the head_dim axis contiguous")
    out = torch.empty_like(q)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    block_m = block_m or (64 if head_dim_pad > 128 else 128)
    block_m = max(block_m, triton.next_power_of_2(group), 16)
    tile_n = tile_n or (32 if head_dim_pad > 128 else 64)
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2E,
        sliding_window or 0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None,
        **dot_flags(q.dtype),
        num_warps=8 if block_m >= 128 else 4,
    )
    return out
