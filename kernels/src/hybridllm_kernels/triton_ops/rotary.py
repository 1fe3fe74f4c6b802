"""Rotary position embedding applied in place to Q and K, one program per token.

Each program loads the token's cos/sin row once and rotates every head of Q and then K.
``is_neox`` pairs dim ``i`` with ``i + rotary_dim/2`` (rotate-half, Llama in Hugging Face
layout); otherwise it pairs ``2i`` with ``2i+1`` (GPT-J). Dims past ``rotary_dim`` are
untouched (partial rotary). Q and K may be strided views of a fused QKV output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    num_heads,
    cos,
    sin,
    i,
    i_mask,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < num_heads) & i_mask[None, :]
    if IS_NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    p1 = x_ptr + h * stride_h + i1[None, :]
    p2 = x_ptr + h * stride_h + i2[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        stride_qh,
        num_heads,
        cos,
        sin,
        i,
        i_mask,
        BLOCK_HQ,
        IS_NEOX,
        HALF,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        stride_kh,
        num_kv_heads,
        cos,
        sin,
        i,
        i_mask,
        BLOCK_HK,
        IS_NEOX,
        HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            "rotary_embedding needs the last axis of q, k and cos_sin_cache contiguous"
        )
    if num_tokens == 0:
        return q, k
    half = rotary_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox,
    )
    return q, k
