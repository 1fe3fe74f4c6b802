"""Triton paged attention (decode and prefill/extend) against the torch reference.

On CPU these run under Triton's interpreter at tiny shapes, with tile and partition sizes
forced small so that one call covers several key tiles, several split-K partitions, tiles
that straddle cache blocks and partial last blocks. The ``gpu`` tests repeat the comparison
at engine-sized shapes with the default launch parameters.
"""

from __future__ import annotations

import pytest
import torch

from hybridllm_kernels import reference
from hybridllm_kernels.testing import make_paged_kv

triton_ops = pytest.importorskip("hybridllm_kernels.triton_ops")

DTYPES = [torch.float32, torch.bfloat16]


def _decode_case(lens, num_kv_heads, group, head_dim, block_size, dtype, device, seed=0):
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    return q, kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("partition_size", [None, 8])
def test_decode_matches_reference(dtype, group, partition_size, device, check_close) -> None:
    # Lengths: 1, exactly one block, not a multiple of the block size, several partitions.
    lens = [1, 4, 7, 29]
    q, kv = _decode_case(lens, 2, group, 16, 4, dtype, device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25)
    out = triton_ops.paged_decode_attention(*args, partition_size=partition_size, tile_n=8)
    check_close(out, reference.paged_decode_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [None, 8])
def test_decode_sliding_window_never_reads_freed_blocks(dtype, partition_size, device, check_close):
    lens = [3, 13, 30]
    window = 6
    q, kv = _decode_case(lens, 1, 4, 16, 4, dtype, device)
    # Blocks wholly before the window are freed by the engine: punch holes in the table and
    # poison the blocks they pointed at; the output must not change.
    for s, n in enumerate(lens):
        for b in range(max(0, n - window) // 4):
            kv.k_cache[kv.block_tables[s, b]] = float("nan")
            kv.v_cache[kv.block_tables[s, b]] = float("nan")
            kv.block_tables[s, b] = -1
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.25, window)
    out = triton_ops.paged_decode_attention(*args, partition_size=partition_size, tile_n=8)
    assert not out.isnan().any()
    check_close(out, reference.paged_decode_attention(*args))


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_decode_head_dims(head_dim, device, check_close) -> None:
    # 80 is not a power of two (padded and masked); 256 is the largest head dim we serve.
    q, kv = _decode_case([5, 18], 1, 3, head_dim, 8, torch.bfloat16, device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)
    out = triton_ops.paged_decode_attention(*args, tile_n=16)
    check_close(out, reference.paged_decode_attention(*args))


def test_decode_split_count_follows_table_width_not_contexts() -> None:
    splits, partition = triton_ops.decode_attention.plan_splits(
        num_seqs=2, num_kv_heads=8, max_tokens=32768, tile_n=64, num_sms=132
    )
    assert splits > 1
    assert partition % 64 == 0
    assert splits * partition >= 32768
    assert (splits - 1) * partition < 32768
    # A batch that already fills the GPU runs one pass.
    assert triton_ops.decode_attention.plan_splits(256, 8, 4096, 64, 132) == (1, 4096)


def _prefill_case(prefix_lens, q_lens, num_kv_heads, group, head_dim, block_size, dtype, device):
    lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    kv = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(device)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32, device=device)
    return q, kv, qsl


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(dtype, group, device, check_close) -> None:
    # Fresh prompt, chunk after a cached prefix (prefix-cache hit / chunked prefill), a
    # single-token extend, and a chunk longer than one query block.
    prefix_lens = [0, 9, 12, 3]
    q_lens = [6, 5, 1, 11]
    q, kv, qsl = _prefill_case(prefix_lens, q_lens, 2, group, 16, 4, dtype, device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.25)
    out = triton_ops.paged_prefill_attention(*args, block_m=16, tile_n=8)
    check_close(out, reference.paged_prefill_attention(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_sliding_window_and_odd_group(dtype, device, check_close) -> None:
    # SmolLM2-135M has 9 query heads over 3 KV heads: a group of 3, not a power of two.
    window = 5
    q, kv, qsl = _prefill_case([0, 10], [13, 4], 3, 3, 16, 4, dtype, device)
    # Sequence 1's first new token is at position 10 and sees keys from 6 on: block 0
    # (positions 0-3) is out of every query's window, so the engine may have freed it.
    kv.k_cache[kv.block_tables[1, 0]] = float("nan")
    kv.v_cache[kv.block_tables[1, 0]] = float("nan")
    kv.block_tables[1, 0] = -1
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.25, window)
    out = triton_ops.paged_prefill_attention(*args, block_m=16, tile_n=8)
    check_close(out, reference.paged_prefill_attention(*args))


def test_prefill_head_dim_256(device, check_close) -> None:
    q, kv, qsl = _prefill_case([4], [7], 1, 2, 256, 8, torch.bfloat16, device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 256**-0.5)
    out = triton_ops.paged_prefill_attention(*args, block_m=16, tile_n=16)
    check_close(out, reference.paged_prefill_attention(*args))


def test_prefill_last_token_equals_decode(device, check_close) -> None:
    q, kv, qsl = _prefill_case([5, 0], [3, 9], 2, 4, 16, 4, torch.float32, device)
    out = triton_ops.paged_prefill_attention(
        q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.3, block_m=16, tile_n=8
    )
    last = (qsl[1:] - 1).long()
    decode = triton_ops.paged_decode_attention(
        q[last], kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.3, tile_n=8
    )
    check_close(out[last], decode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (4, 128), (8, 128), (3, 64), (2, 256)])
def test_decode_full_shapes_gpu(dtype, group, head_dim, check_close) -> None:
    lens = [1, 17, 4096, 5000, 8191, 300] * 6
    q, kv = _decode_case(lens, 8, group, head_dim, 16, dtype, "cuda")
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)
    check_close(triton_ops.paged_decode_attention(*args), reference.paged_decode_attention(*args))
    windowed = (*args, 1024)
    check_close(
        triton_ops.paged_decode_attention(*windowed), reference.paged_decode_attention(*windowed)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (4, 128), (8, 128), (3, 64), (2, 256)])
def test_prefill_full_shapes_gpu(dtype, group, head_dim, check_close) -> None:
    q, kv, qsl = _prefill_case(
        [0, 1000, 37, 2048], [512, 333, 1, 1024], 8, group, head_dim, 16, dtype, "cuda"
    )
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, head_dim**-0.5)
    check_close(triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))
    windowed = (*args, 256)
    check_close(
        triton_ops.paged_prefill_attention(*windowed), reference.paged_prefill_attention(*windowed)
    )
