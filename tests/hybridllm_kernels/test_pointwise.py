"""Triton norms, rotary, SiLU-and-mul, W8A16 matmul and KV write against the torch reference."""

from __future__ import annotations

import pytest
import torch

from hybridllm_kernels import reference

triton_ops = pytest.importorskip("hybridllm_kernels.triton_ops")

DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 48, 576])  # 576 = SmolLM2-135M, not a power of two
def test_rms_norms(dtype, hidden, device, check_close) -> None:
    x = _randn(5, hidden, dtype=dtype, device=device)
    residual = _randn(5, hidden, dtype=dtype, device=device, seed=1)
    weight = _randn(hidden, dtype=dtype, device=device, seed=2)
    x0, residual0 = x.clone(), residual.clone()
    check_close(triton_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    if device == "cuda":
        assert torch.equal(new_residual, ref_residual)  # one rounding of an fp32 sum: exact
    else:
        # The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest.
        check_close(new_residual, ref_residual)
    check_close(out, ref_out)
    assert torch.equal(x, x0)
    assert torch.equal(residual, residual0)


def test_rms_norm_keeps_leading_shape(device, check_close) -> None:
    x = _randn(2, 3, 32, dtype=torch.float32, device=device)
    weight = _randn(32, dtype=torch.float32, device=device, seed=1)
    out = triton_ops.rms_norm(x, weight, 1e-6)
    assert out.shape == (2, 3, 32)
    check_close(out, reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (12, 8), (256, 256)])
def test_rotary_in_place(dtype, is_neox, head_dim, rotary_dim, device, check_close) -> None:
    num_tokens, num_heads, num_kv_heads = 5, 9, 3
    angles = torch.arange(40).float()[:, None] * torch.rand(rotary_dim // 2)[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype).to(device)
    positions = torch.tensor([0, 1, 39, 7, 7], device=device)
    # q and k as strided views of one fused QKV projection, as the engine produces them.
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cache, is_neox)
    q_out, k_out = triton_ops.rotary_embedding(positions, q, k, cache, is_neox)
    assert q_out.data_ptr() == q.data_ptr()
    assert k_out.data_ptr() == k.data_ptr()
    check_close(q, q_ref)
    check_close(k, k_ref)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 96, 1536])  # 1536 = SmolLM2-135M intermediate size
def test_silu_and_mul(dtype, d, device, check_close) -> None:
    x = _randn(3, 2 * d, dtype=dtype, device=device)
    check_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 70), (17, 24, 128), (70, 130, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a16_matmul(dtype, m, n, k, with_bias, device, check_close) -> None:
    w_int8, scales = reference.quantize_per_channel_int8(
        _randn(n, k, dtype=torch.float32, device=device)
    )
    # Inputs scaled so outputs are O(1), the magnitude the tolerances are written for.
    x = (_randn(m, k, dtype=torch.float32, device=device, seed=1) / k**0.5).to(dtype)
    bias = _randn(n, dtype=dtype, device=device, seed=2) if with_bias else None
    out = triton_ops.w8a16_matmul(x, w_int8, scales, bias)
    check_close(out, reference.w8a16_matmul(x, w_int8, scales, bias))


def test_w8a16_rejects_unquantized_weights(device) -> None:
    x = _randn(2, 8, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="int8"):
        triton_ops.w8a16_matmul(x, _randn(4, 8, dtype=torch.float32, device=device), torch.ones(4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_and_skips_padding(dtype, device) -> None:
    shape = (6, 4, 2, 16)  # 6 blocks of 4 slots
    k_cache = _randn(*shape, dtype=dtype, device=device)
    v_cache = _randn(*shape, dtype=dtype, device=device, seed=1)
    k = _randn(5, 2, 16, dtype=dtype, device=device, seed=2)
    v = _randn(5, 2, 16, dtype=dtype, device=device, seed=3)
    slots = torch.tensor([0, 23, -1, 9, 10], device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k, v, k_ref, v_ref, slots)
    triton_ops.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[5, 3], k[1])  # slot 23 = block 5, offset 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pointwise_full_shapes_gpu(dtype, check_close) -> None:
    x = _randn(4096, 4096, dtype=dtype, device="cuda")
    residual = _randn(4096, 4096, dtype=dtype, device="cuda", seed=1)
    weight = _randn(4096, dtype=dtype, device="cuda", seed=2)
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    check_close(out, ref_out)
    check_close(new_residual, ref_residual)
    check_close(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))
    w_int8, scales = reference.quantize_per_channel_int8(
        _randn(11008, 4096, dtype=torch.float32, device="cuda")
    )
    for m in (1, 32, 512):
        xm = (x[:m].float() / 64).to(dtype)
        check_close(
            triton_ops.w8a16_matmul(xm, w_int8, scales), reference.w8a16_matmul(xm, w_int8, scales)
        )
    angles = (
        torch.arange(8192, device="cuda").float()[:, None] * torch.rand(64, device="cuda")[None, :]
    )
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    positions = torch.randint(0, 8192, (4096,), device="cuda")
    q, k = x.view(4096, 32, 128).clone(), residual[:, :1024].reshape(4096, 8, 128).clone()
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cache)
    triton_ops.rotary_embedding(positions, q, k, cache)
    check_close(q, q_ref)
    check_close(k, k_ref)
