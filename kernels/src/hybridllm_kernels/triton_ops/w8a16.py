"""Weight-only int8 matmul (W8A16): ``out = (x @ w_int8.T) * scales + bias``.

A tiled matmul whose B operand is loaded as int8 (half the bytes of bf16, which is the
point: decode-time GEMMs are bound by weight bandwidth) and converted to x's dtype in
registers; int8 values are exact in bf16/fp16. The per-output-channel scale is applied
once to the float32 accumulator, after the K loop. Tile sizes follow M: decode batches
(M <= 16) use the smallest M tile and wide N tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridllm_kernels.triton_ops._common import dot, dot_flags


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=n_mask[None, :] & k_mask[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        if DOT_UPCAST:
            acc = dot(x, w.to(tl.float32), acc, DOT_PRECISION, DOT_UPCAST)
        else:
            acc = dot(x, w.to(x.dtype), acc, DOT_PRECISION, DOT_UPCAST)
    acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by batch size."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 32, 8


def w8a16_matmul(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    w_int8: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n = w_int8.shape[0]
    if w_int8.dtype != torch.int8 or w_int8.shape[1] != k:
        raise ValueError(f"w_int8 must be int8 [N, {k}], got {w_int8.dtype} {list(w_int8.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x,
        w_int8,
        scales,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w_int8.stride(0),
        w_int8.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        **dot_flags(x.dtype),
        num_warps=num_warps,
    )
    return out
