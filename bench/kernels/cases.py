"""Benchmark cases: each builds its inputs once and returns the callables to time.

A case names the bytes it must move at least once (its inputs read and outputs written),
so a time converts to achieved bandwidth; decode attention, whose K/V reads dominate,
is judged by that figure against the GPU's peak.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridllm_kernels import reference
from hybridllm_kernels.testing import make_paged_kv


@dataclass
class Case:
    kernel: str
    params: dict[str, int | str]
    bytes_moved: int
    # name -> callable; "triton" is the kernel, the rest are peers measured in the same run.
    impls: dict[str, Callable[[], object]] = field(default_factory=dict)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _with_triton(impls: dict[str, Callable[[], object]], triton_fn: Callable[[], object] | None):
    if triton_fn is not None:
        impls = {"triton": triton_fn, **impls}
    return impls


def decode_case(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    triton_ops,
    with_reference: bool,
    tune: bool = False,
) -> Case:
    kv = make_paged_kv(
        [context] * batch, num_kv_heads, head_dim, block_size, dtype, device, extra_table_cols=0
    )
    q = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * q.element_size()
    # The same data laid out contiguously for SDPA: [batch, num_kv_heads, context, head_dim].
    k = torch.randn(batch, num_kv_heads, context, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    q4 = q[:, :, None, :]
    impls: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
    }
    if with_reference:
        impls["torch_ref"] = lambda: reference.paged_decode_attention(*args)
    triton_fn = (lambda: triton_ops.paged_decode_attention(*args)) if triton_ops else None
    if triton_ops and tune:
        for tile_n in (32, 64, 128):
            for num_warps in (4, 8):
                impls[f"triton_t{tile_n}_w{num_warps}"] = functools.partial(
                    triton_ops.paged_decode_attention, *args, tile_n=tile_n, num_warps=num_warps
                )
    return Case(
        "paged_decode_attention",
        {
            "batch": batch,
            "context": context,
            "heads": f"{num_heads}/{num_kv_heads}",
            "head_dim": head_dim,
        },
        kv_bytes + 2 * _nbytes(q) + _nbytes(kv.block_tables),
        _with_triton(impls, triton_fn),
    )


def prefill_case(
    batch: int,
    q_len: int,
    prefix: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    triton_ops,
    with_reference: bool,
) -> Case:
    context = prefix + q_len
    kv = make_paged_kv(
        [context] * batch, num_kv_heads, head_dim, block_size, dtype, device, extra_table_cols=0
    )
    q = torch.randn(batch * q_len, num_heads, head_dim, device=device).to(dtype)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, scale)
    k = torch.randn(batch, num_kv_heads, context, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    q4 = q.view(batch, q_len, num_heads, head_dim).transpose(1, 2)
    # SDPA's is_causal aligns the mask top-left; with a prefix it needs an explicit mask.
    mask = torch.ones(q_len, context, dtype=torch.bool, device=device).tril(diagonal=prefix)
    impls: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(
            q4,
            k,
            v,
            attn_mask=None if prefix == 0 else mask,
            is_causal=prefix == 0,
            scale=scale,
            enable_gqa=True,
        ),
    }
    if with_reference:
        impls["torch_ref"] = lambda: reference.paged_prefill_attention(*args)
    triton_fn = (lambda: triton_ops.paged_prefill_attention(*args)) if triton_ops else None
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * q.element_size()
    return Case(
        "paged_prefill_attention",
        {
            "batch": batch,
            "q_len": q_len,
            "prefix": prefix,
            "heads": f"{num_heads}/{num_kv_heads}",
            "head_dim": head_dim,
        },
        kv_bytes + 2 * _nbytes(q),
        _with_triton(impls, triton_fn),
    )


def pointwise_cases(
    tokens: int, hidden: int, intermediate: int, dtype: torch.dtype, device: str, triton_ops
) -> list[Case]:
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=device).to(dtype)
    gate_up = torch.randn(tokens, 2 * intermediate, device=device).to(dtype)
    num_heads, num_kv_heads, head_dim = hidden // 128, max(hidden // 512, 1), 128
    q = torch.randn(tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, device=device).to(dtype)
    angles = (
        torch.arange(8192, device=device).float()[:, None]
        * torch.rand(head_dim // 2, device=device)[None, :]
    )
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    k_cache = torch.zeros(tokens // 16 + 1, 16, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, device=device)[:tokens]
    t = triton_ops
    params = {"tokens": tokens, "hidden": hidden}
    return [
        Case(
            "fused_add_rms_norm",
            params,
            5 * _nbytes(x),
            _with_triton(
                {"torch_ref": lambda: reference.fused_add_rms_norm(x, residual, weight, 1e-6)},
                (lambda: t.fused_add_rms_norm(x, residual, weight, 1e-6)) if t else None,
            ),
        ),
        Case(
            "silu_and_mul",
            {"tokens": tokens, "intermediate": intermediate},
            _nbytes(gate_up) * 3 // 2,
            _with_triton(
                {"torch_ref": lambda: reference.silu_and_mul(gate_up)},
                (lambda: t.silu_and_mul(gate_up)) if t else None,
            ),
        ),
        Case(
            "rotary_embedding",
            {"tokens": tokens, "heads": f"{num_heads}/{num_kv_heads}"},
            2 * _nbytes(q, k),
            _with_triton(
                {"torch_ref": lambda: reference.rotary_embedding(positions, q, k, cos_sin)},
                (lambda: t.rotary_embedding(positions, q, k, cos_sin)) if t else None,
            ),
        ),
        Case(
            "write_kv",
            {"tokens": tokens, "kv_heads": num_kv_heads},
            4 * _nbytes(k),
            _with_triton(
                {"torch_ref": lambda: reference.write_kv(k, k, k_cache, v_cache, slots)},
                (lambda: t.write_kv(k, k, k_cache, v_cache, slots)) if t else None,
            ),
        ),
    ]


def w8a16_case(m: int, n: int, k: int, dtype: torch.dtype, device: str, triton_ops) -> Case:
    w = torch.randn(n, k, device=device)
    w_int8, scales = reference.quantize_per_channel_int8(w)
    w16 = w.to(dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    impls: dict[str, Callable[[], object]] = {
        "torch_ref": lambda: reference.w8a16_matmul(x, w_int8, scales),
        "torch_matmul_16bit": lambda: x @ w16.t(),
    }
    return Case(
        "w8a16_matmul",
        {"m": m, "n": n, "k": k},
        _nbytes(w_int8, x, scales) + m * n * x.element_size(),
        _with_triton(
            impls, (lambda: triton_ops.w8a16_matmul(x, w_int8, scales)) if triton_ops else None
        ),
    )
