"""The dispatch layer: the only way the engine calls a kernel.

The backend is chosen once, when this module is imported:

- ``HYBRIDLLM_KERNELS=torch`` forces the plain-torch references (``reference.py``);
- ``HYBRIDLLM_KERNELS=triton`` forces the Triton kernels; without a CUDA device this needs
  ``TRITON_INTERPRET=1`` (set before anything imports triton), which runs them on CPU;
- unset (or ``auto``): Triton when a CUDA device is present and triton imports, torch otherwise.

With the Triton backend, a call whose tensors are not on a CUDA device still goes to the
reference unless the interpreter is on: an engine instance on CPU, on a machine that has a
GPU, keeps working. That check reads ``tensor.is_cuda`` only; it never synchronises.

The public functions below are thin and typed; their docstrings live on the references.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Literal

import torch

from hybridllm_kernels import reference

log = logging.getLogger(__name__)

Backend = Literal["torch", "triton"]
ENV_VAR = "HYBRIDLLM_KERNELS"


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(requested: str | None, cuda_available: bool, interpreter: bool) -> Backend:
    """Pure decision, tested on its own: which backend a process with these facts gets."""
    choice = (requested or "auto").strip().lower()
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not cuda_available and not interpreter:
            raise RuntimeError(
                f"{ENV_VAR}=triton needs a CUDA device, or TRITON_INTERPRET=1 set before "
                "triton is imported to run the Triton kernels on CPU"
            )
        return "triton"
    if choice != "auto":
        raise ValueError(f"{ENV_VAR} must be 'torch', 'triton' or 'auto', not {requested!r}")
    return "triton" if cuda_available else "torch"


def _load_backend() -> tuple[Backend, ModuleType | None]:
    requested = os.environ.get(ENV_VAR)
    backend = select_backend(requested, torch.cuda.is_available(), _interpreter_on())
    if backend == "torch":
        log.debug("hybridllm kernels: torch reference backend")
        return backend, None
    try:
        from hybridllm_kernels import triton_ops
    except ImportError as exc:
        if requested == "triton":
            raise
        log.warning("triton unavailable (%s); using the torch reference kernels", exc)
        return "torch", None
    log.debug("hybridllm kernels: triton backend (interpreter=%s)", _interpreter_on())
    return backend, triton_ops


BACKEND, _TRITON = _load_backend()
_INTERPRET = _interpreter_on()


def backend_name() -> str:
    """``torch``, ``triton`` or ``triton-interpret``: what this process dispatches to."""
    if BACKEND == "triton" and _INTERPRET:
        return "triton-interpret"
    return BACKEND


def _impl(t: torch.Tensor) -> ModuleType:
    if _TRITON is not None and (t.is_cuda or _INTERPRET):
        return _TRITON
    return reference


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    _impl(k_cache).write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    return _impl(q).paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return _impl(q).paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl(x).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x).fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(q).rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _impl(x).silu_and_mul(x)


def w8a16_matmul(
    x: torch.Tensor,  # [M, K]
    w_int8: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    return _impl(x).w8a16_matmul(x, w_int8, scales, bias)


def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline weight conversion; plain torch on every backend (it runs once per load)."""
    return reference.quantize_per_channel_int8(w)
