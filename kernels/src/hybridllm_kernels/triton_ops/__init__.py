"""Triton implementations, one module per kernel, with the same signatures as ``reference``.

Importing this package imports triton: with no CUDA device, set ``TRITON_INTERPRET=1``
first (``triton.jit`` reads it when a kernel is decorated).
"""

from hybridllm_kernels.triton_ops.activation import silu_and_mul
from hybridllm_kernels.triton_ops.decode_attention import paged_decode_attention
from hybridllm_kernels.triton_ops.kv_cache import write_kv
from hybridllm_kernels.triton_ops.norm import fused_add_rms_norm, rms_norm
from hybridllm_kernels.triton_ops.prefill_attention import paged_prefill_attention
from hybridllm_kernels.triton_ops.rotary import rotary_embedding
from hybridllm_kernels.triton_ops.w8a16 import w8a16_matmul

__all__ = [
    "fused_add_rms_norm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "w8a16_matmul",
    "write_kv",
]
