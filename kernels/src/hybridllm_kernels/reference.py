"""Plain-torch references for every kernel: the specification the Triton kernels are tested against.

These run on any device and are what the engine uses where there is no CUDA device. They
favour clarity over speed, but stay vectorised where it costs nothing, because the engine's
CPU path runs through them. All arithmetic that accumulates (softmax, norms, matmul) is
done in float32 and the result is cast back to the input's dtype.

Layouts (the contract with ``hybridllm_cloud``):

- KV cache per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a slot is
  ``block_id * block_size + offset``.
- ``block_tables`` int32 ``[num_seqs, max_blocks_per_seq]``; entries past
  ``ceil(context_len / block_size)`` are never read (they may hold -1).
- Sliding window ``W``: a query at position ``p`` sees keys at positions ``k`` with
  ``p - W < k <= p`` (``W`` tokens including itself; Mistral / Hugging Face convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_ids = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[block_ids, offsets] = k[keep].to(k_cache.dtype)
    v_cache[block_ids, offsets] = v[keep].to(v_cache.dtype)


def _gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    block_needed: torch.Tensor,  # [num_seqs, num_table_blocks] bool
    token_valid: torch.Tensor,  # [num_seqs, num_table_blocks * block_size] bool
) -> torch.Tensor:  # [num_seqs, num_kv_heads, num_table_blocks * block_size, head_dim] float32
    """Whole blocks, read only where needed (other table entries may hold -1 or garbage);
    invalid token rows are zeroed, since stale cache memory may hold NaN and 0 * NaN = NaN.

    Only the invalid rows are written (``index_fill_`` over their flat indices): in decode
    they are a block's unfilled tail and table padding, a small share of the gathered keys,
    so this costs far less than a masked pass over every key (measured: a fifth of a
    batch-32 decode step's CPU time went to that pass)."""
    num_table_blocks = block_needed.shape[1]
    table = block_tables[:, :num_table_blocks].long()
    table = torch.where(block_needed, table, torch.zeros_like(table))
    # index_select over whole blocks as rows: on CPU a row copy each, 2.5x faster than
    # advanced indexing (``cache[table]``), which goes element by element.
    rows = cache.reshape(cache.shape[0], -1).index_select(0, table.flatten())
    tokens = rows.view(table.shape[0], -1, *cache.shape[2:]).float()  # [S, T, Hkv, D], a copy
    invalid = (~token_valid).flatten().nonzero().squeeze(1)
    if invalid.numel():
        tokens.view(-1, tokens.shape[2] * tokens.shape[3]).index_fill_(0, invalid, 0.0)
    return tokens.transpose(1, 2)


def _visible_keys(
    context_lens: torch.Tensor,  # [num_seqs]
    first_query_pos: torch.Tensor,  # [num_seqs]: the earliest query position of each sequence
    num_table_blocks: int,
    block_size: int,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_needed, token_valid): keys in [first visible, context_len) of each sequence."""
    positions = torch.arange(num_table_blocks * block_size, device=context_lens.device)
    lens = context_lens.long()[:, None]
    lo = torch.zeros_like(lens)
    if sliding_window is not None:
        lo = (first_query_pos.long()[:, None] - sliding_window + 1).clamp(min=0)
    token_valid = (positions[None, :] < lens) & (positions[None, :] >= lo)
    block_needed = token_valid.view(len(lens), num_table_blocks, block_size).any(dim=-1)
    return block_needed, token_valid


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_table_blocks = -(-int(context_lens.max().item()) // block_size)
    block_needed, token_valid = _visible_keys(
        context_lens, context_lens - 1, num_table_blocks, block_size, sliding_window
    )
    k = _gather_blocks(k_cache, block_tables, block_needed, token_valid)  # [S, Hkv, T, D]
    v = _gather_blocks(v_cache, block_tables, block_needed, token_valid)
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        qg, k, v, attn_mask=token_valid[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + new tokens
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for seq_idx, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[seq_idx], starts[seq_idx + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_table_blocks = -(-context_len // block_size)
        lens = context_lens[seq_idx : seq_idx + 1]
        block_needed, token_valid = _visible_keys(
            lens, lens - q_len, num_table_blocks, block_size, sliding_window
        )
        table = block_tables[seq_idx : seq_idx + 1]
        k = _gather_blocks(k_cache, table, block_needed, token_valid)[0]  # [Hkv, T, D]
        v = _gather_blocks(v_cache, table, block_needed, token_valid)[0]
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(k.shape[1], device=q.device)
        visible = (k_pos[None, :] <= q_pos[:, None]) & token_valid  # [q_len, T]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        qs = q[q_start:q_end].float().transpose(0, 1)  # [num_heads, q_len, head_dim]
        o = F.scaled_dot_product_attention(
            qs, k, v, attn_mask=visible, scale=scale, enable_gqa=True
        )
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to x's dtype
    before it is normalised (vLLM semantics). Inputs are not modified."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]: cos | sin
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the first ``rotary_dim`` dims of every head in place; returns ``(q, k)``."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [num_tokens, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        rot = x[..., :rotary_dim].float()
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        rotated = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        x[..., :rotary_dim] = rotated.to(x.dtype)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def quantize_per_channel_int8(
    w: torch.Tensor,  # [N, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 [N, K], float32 scales [N]
    """Symmetric per-output-channel int8: ``w ~= w_int8 * scales[:, None]``."""
    wf = w.float()
    scales = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    w_int8 = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return w_int8, scales


def w8a16_matmul(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32
    w_int8: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    if (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and x.shape[1] % 32 == 0  # the kernel reads K in vector tiles: odd K is unsafe
    ):
        # torch's CPU int8-weight kernel: weights stay int8 in memory, no dequantised copy
        # (about the speed of a bf16 matmul, a quarter of its weight bytes).
        out = torch._weight_int8pack_mm(x.contiguous(), w_int8, scales.to(x.dtype))
        return out if bias is None else out + bias.to(x.dtype)
    out = (x.float() @ w_int8.float().t()) * scales.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
