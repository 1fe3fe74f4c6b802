"""The torch references against independent formulations (SDPA, explicit loops), and the
dispatch decision. These are the specification the Triton kernels are held to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hybridllm_kernels import ops, reference
from hybridllm_kernels.testing import make_paged_kv


def _contiguous_kv(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """[n, num_kv_heads, head_dim] read token by token through the block table."""
    block_size = cache.shape[1]
    return torch.stack([cache[int(table[t // block_size]), t % block_size] for t in range(n)])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor):
    """q [q_len, H, D], k/v [n, H_kv, D], mask [q_len, n] bool (True = visible)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    out = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reference_matches_sdpa(group: int, sliding_window: int | None) -> None:
    lens = [1, 7, 16, 21]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    q = torch.randn(len(lens), 2 * group, 16)
    out = reference.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25, sliding_window
    )
    for s, n in enumerate(lens):
        k = _contiguous_kv(kv.k_cache, kv.block_tables[s], n)
        v = _contiguous_kv(kv.v_cache, kv.block_tables[s], n)
        mask = torch.ones(1, n, dtype=torch.bool)
        if sliding_window is not None:
            mask[0, : max(0, n - sliding_window)] = False
        expected = _sdpa(q[s : s + 1], k, v, 0.25, mask)[0]
        torch.testing.assert_close(out[s], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_prefill_reference_matches_sdpa_and_decode(sliding_window: int | None) -> None:
    lens = [6, 9, 1]  # cached prefix + new tokens
    q_lens = [2, 9, 1]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    q = torch.randn(sum(q_lens), 4, 8)
    qsl = torch.tensor([0, 2, 11, 12], dtype=torch.int32)
    out = reference.paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.3, sliding_window
    )
    for s, (n, q_len) in enumerate(zip(lens, q_lens, strict=True)):
        k = _contiguous_kv(kv.k_cache, kv.block_tables[s], n)
        v = _contiguous_kv(kv.v_cache, kv.block_tables[s], n)
        q_pos = torch.arange(n - q_len, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        expected = _sdpa(q[qsl[s] : qsl[s + 1]], k, v, 0.3, mask)
        torch.testing.assert_close(out[qsl[s] : qsl[s + 1]], expected, atol=1e-5, rtol=1e-5)
    # The last new token of a sequence is exactly a decode step over the same cache.
    last = qsl[1:] - 1
    decode = reference.paged_decode_attention(
        q[last], kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3, sliding_window
    )
    torch.testing.assert_close(out[last], decode, atol=1e-5, rtol=1e-5)


def test_write_kv_reference_skips_padding_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    reference.write_kv(k, v, k_cache, v_cache, torch.tensor([9, -1, 2]))
    torch.testing.assert_close(k_cache[2, 1], k[0])
    torch.testing.assert_close(v_cache[0, 2], v[2])
    assert int((k_cache != 0).any(dim=(-1, -2)).sum()) == 2


def test_norm_and_activation_references() -> None:
    x = torch.randn(5, 32)
    res = torch.randn(5, 32)
    w = torch.randn(32)
    expected = (x + res) / torch.sqrt(((x + res) ** 2).mean(-1, keepdim=True) + 1e-6) * w
    out, new_res = reference.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(reference.rms_norm(x + res, w, 1e-6), expected)
    torch.testing.assert_close(reference.silu_and_mul(x[:, :32]), F.silu(x[:, :16]) * x[:, 16:])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_reference_rotates_pairs_by_position_angle(is_neox: bool) -> None:
    head_dim, rotary_dim = 8, 4
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(16).float()[:, None] * inv_freq[None, :]  # [16, rot/2]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.tensor([0, 3, 15])
    q = torch.randn(3, 2, head_dim)
    k = torch.randn(3, 1, head_dim)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = reference.rotary_embedding(positions, q, k, cache, is_neox)
    assert q_out is q
    assert k_out is k
    half = rotary_dim // 2
    for x0, x in ((q0, q), (k0, k)):
        for t, p in enumerate(positions.tolist()):
            for i in range(half):
                a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
                c, s = angles[p, i].cos(), angles[p, i].sin()
                torch.testing.assert_close(x[t, :, a], x0[t, :, a] * c - x0[t, :, b] * s)
                torch.testing.assert_close(x[t, :, b], x0[t, :, b] * c + x0[t, :, a] * s)
        torch.testing.assert_close(x[..., rotary_dim:], x0[..., rotary_dim:])


def test_int8_quantization_round_trip() -> None:
    w = torch.randn(24, 40)
    w_int8, scales = reference.quantize_per_channel_int8(w)
    assert w_int8.dtype == torch.int8
    assert scales.shape == (24,)
    assert int(w_int8.abs().max()) == 127
    torch.testing.assert_close(
        w_int8.float() * scales[:, None], w, atol=float(scales.max()) / 2, rtol=0
    )
    x = torch.randn(3, 40)
    bias = torch.randn(24)
    expected = x @ (w_int8.float() * scales[:, None]).t() + bias
    torch.testing.assert_close(reference.w8a16_matmul(x, w_int8, scales, bias), expected)


def test_backend_selection() -> None:
    assert ops.select_backend(None, cuda_available=False, interpreter=False) == "torch"
    assert ops.select_backend("auto", cuda_available=True, interpreter=False) == "triton"
    assert ops.select_backend("torch", cuda_available=True, interpreter=False) == "torch"
    assert ops.select_backend("triton", cuda_available=False, interpreter=True) == "triton"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.select_backend("triton", cuda_available=False, interpreter=False)
    with pytest.raises(ValueError, match="HYBRIDLLM_KERNELS"):
        ops.select_backend("cuda", cuda_available=True, interpreter=False)


def test_dispatch_runs_every_op_on_cpu() -> None:
    kv = make_paged_kv([5, 3], num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    q = torch.randn(2, 2, 8)
    expected = reference.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.5
    )
    out = ops.paged_decode_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.5
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert ops.backend_name() in {"torch", "triton", "triton-interpret"}


def test_dispatch_forced_to_triton_runs_the_kernels(tmp_path) -> None:
    """HYBRIDLLM_KERNELS=triton (with the interpreter on CPU) routes every op to Triton.

    A fresh process, since the backend is chosen once at import."""
    script = tmp_path / "run_ops.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from hybridllm_kernels import ops, reference, triton_ops
            from hybridllm_kernels.testing import make_paged_kv

            assert ops.BACKEND == "triton", ops.BACKEND
            assert ops._impl(torch.zeros(1)) is triton_ops
            kv = make_paged_kv([3, 9], 2, 16, 4, torch.float32)
            q = torch.randn(2, 4, 16)
            args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25)
            diff = (ops.paged_decode_attention(*args) - reference.paged_decode_attention(*args))
            assert diff.abs().max() < 1e-5, diff
            x = torch.randn(3, 64)
            assert (ops.silu_and_mul(x) - reference.silu_and_mul(x)).abs().max() < 1e-6
            print("backend", ops.backend_name())
            """
        )
    )
    env = {**os.environ, "HYBRIDLLM_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "backend triton" in result.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 960, 576), (7, 576, 1536), (3, 40, 70)])
def test_w8a16_cpu_int8_kernel_matches_dequantised(dtype, m, n, k) -> None:
    """The CPU fast path (int8 weights in place) computes what dequantising would."""
    gen = torch.Generator().manual_seed(0)
    w_int8, scales = reference.quantize_per_channel_int8(torch.randn(n, k, generator=gen))
    x = (torch.randn(m, k, generator=gen) / k**0.5).to(dtype)
    want = (x.float() @ (w_int8.float() * scales[:, None]).t()).to(dtype)
    torch.testing.assert_close(
        reference.w8a16_matmul(x, w_int8, scales), want, rtol=0.03, atol=0.03
    )
