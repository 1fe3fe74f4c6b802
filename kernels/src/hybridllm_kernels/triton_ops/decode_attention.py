"""Paged decode attention: one query token per sequence over its paged KV cache.

Organisation (after reading vLLM's paged_attention v1/v2, its Triton unified attention, and
FlashInfer's decode kernels; the code is our own):

- One program per (sequence, KV head, split). A program loads the query rows of every head
  in the KV head's GQA group (padded to 16 rows, the smallest ``tl.dot`` tile), so each K/V
  byte is read from HBM once per group rather than once per query head.
- Keys are walked in tiles of ``tile_n`` tokens, independent of the cache block size: each
  token's block id is gathered from the block table, so a tile spans several blocks and
  the loads stay wide. Entries of the table past the sequence (or, with a sliding window,
  before it) are never dereferenced.
- Online softmax in base 2 (``scale * log2(e)`` is folded into the scores).
- Split-K (flash-decoding): the key range is cut into partitions of ``partition_size``
  tokens, each handled by its own program, which writes a normalised partial output and
  its log-sum-exp; a second kernel combines them. The number of splits is computed from
  the block table's width (an upper bound of every context), never from
  ``context_lens.max()``, so there is no host-device sync: programs whose partition lies
  past a sequence's end (or before its window) return at once. Splits are used only when
  (sequences x KV heads) alone would not fill the GPU; otherwise one pass writes the output.

Because the split count follows the table width, the engine should size ``block_tables``
to the longest sequence of the batch (as vLLM does), not to the model's maximum length.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from hybridllm_kernels.triton_ops._common import LOG2E, dot, dot_flags

MIN_DOT_ROWS = 16


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    sliding_window,
    partition_size,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_os,
    stride_oh,
    stride_osplit,
    stride_ls,
    stride_lh,
    head_dim,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    window_start = 0
    if USE_WINDOW:
        window_start = tl.maximum(context_len - sliding_window, 0)
    part_start = split * partition_size
    part_end = tl.minimum(part_start + partition_size, context_len)
    lo = tl.maximum(part_start, (window_start // TILE_N) * TILE_N)
    if lo >= part_end:
        return

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < head_dim
    heads = kv_head * GROUP + g
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D]

    # A finite floor for the running max keeps exp2(m_old - m_new) defined before the
    # first visible key; masked scores are -inf and contribute exp2(-inf) = 0.
    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(lo, part_end, TILE_N):
        offs = tile_start + tl.arange(0, TILE_N)
        valid = (offs < part_end) & (offs >= window_start)
        block_ids = tl.load(table + offs // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot_offs = offs % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k_ptrs = (
            k_cache_ptr
            + block_ids[:, None] * stride_kb
            + slot_offs[:, None] * stride_ko
            + kv_head * stride_kh
            + d[None, :]
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [TILE_N, D]
        scores = dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_PAD, TILE_N]
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
        out_ptr + seq * stride_os + heads[:, None] * stride_oh + split * stride_osplit + d[None, :]
    )
    out_mask = g_mask[:, None] & d_mask[None, :]
    if WRITE_PARTIAL:
        tl.store(out_ptrs, out, mask=out_mask)
        tl.store(
            lse_ptr + seq * stride_ls + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask
        )
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _combine_kernel(
    partial_ptr,
    lse_ptr,
    context_lens_ptr,
    out_ptr,
    sliding_window,
    partition_size,
    stride_ps,
    stride_ph,
    stride_psplit,
    stride_ls,
    stride_lh,
    stride_os,
    stride_oh,
    head_dim,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    window_start = 0
    if USE_WINDOW:
        window_start = tl.maximum(context_len - sliding_window, 0)
    first = window_start // partition_size
    last = (context_len - 1) // partition_size
    splits = tl.arange(0, SPLITS_PAD)
    lse_base = lse_ptr + seq * stride_ls + head * stride_lh
    lse = tl.load(lse_base + splits, mask=(splits >= first) & (splits <= last), other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weight_sum = tl.sum(tl.exp2(lse - lse_max), axis=0)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < head_dim
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    partial_base = partial_ptr + seq * stride_ps + head * stride_ph + d
    for split in range(first, last + 1):
        weight = tl.exp2(tl.load(lse_base + split) - lse_max)
        acc += weight * tl.load(partial_base + split * stride_psplit, mask=d_mask, other=0.0)
    out = acc / weight_sum
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_tokens: int, tile_n: int, num_sms: int
) -> tuple[int, int]:
    """(num_splits, partition_size): enough programs to keep every SM busy (about four
    per SM), partitions of at least 256 tokens and a multiple of ``tile_n``."""
    programs = num_seqs * num_kv_heads
    wanted = max(1, math.ceil(4 * num_sms / max(programs, 1)))
    num_splits = max(1, min(wanted, math.ceil(max_tokens / 256)))
    partition = math.ceil(math.ceil(max_tokens / num_splits) / tile_n) * tile_n
    return math.ceil(max_tokens / partition), partition


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    partition_size: int | None = None,
    tile_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """``partition_size`` (a multiple of ``tile_n``) forces split-K; tests use it to cover
    the split and single-pass paths at small shapes. ``tile_n`` and ``num_warps`` are
    exposed for the benchmark's tuning sweep (``bench/kernels/run.py --tune``)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention needs the head_dim axis contiguous")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    tile_n = tile_n or 64
    max_tokens = block_tables.shape[1] * block_size
    if partition_size is None:
        num_sms = _num_sms(q.device.index or 0) if q.is_cuda else 1
        num_splits, partition_size = plan_splits(
            num_seqs, num_kv_heads, max_tokens, tile_n, num_sms
        )
    else:
        if partition_size % tile_n:
            raise ValueError(
                f"partition_size {partition_size} is not a multiple of tile_n {tile_n}"
            )
        num_splits = triton.cdiv(max_tokens, partition_size)
    use_window = sliding_window is not None
    common = {
        "GROUP": group,
        "GROUP_PAD": max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
        "TILE_N": tile_n,
        "USE_WINDOW": use_window,
        **dot_flags(q.dtype),
        "num_warps": num_warps,
    }
    grid = (num_seqs, num_kv_heads, num_splits)
    args = (
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
    )
    strides = (
        scale * LOG2E,
        sliding_window or 0,
        partition_size,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
    )
    if num_splits == 1:
        _decode_kernel[grid](
            *args,
            out,
            out,
            *strides,
            out.stride(0),
            out.stride(1),
            0,
            0,
            0,
            head_dim,
            WRITE_PARTIAL=False,
            **common,
        )
        return out
    partial = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[grid](
        *args,
        partial,
        lse,
        *strides,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        head_dim,
        WRITE_PARTIAL=True,
        **common,
    )
    _combine_kernel[(num_seqs, num_heads)](
        partial,
        lse,
        context_lens,
        out,
        sliding_window or 0,
        partition_size,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        USE_WINDOW=use_window,
    )
    return out
