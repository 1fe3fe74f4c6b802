"""Helpers shared by the Triton kernels.

Triton's interpreter (``TRITON_INTERPRET=1``, our CPU test path) stores bfloat16 as raw
uint16 and its ``tl.dot`` multiplies those raw bits, and its int -> bf16 cast is a plain
``astype``; both give garbage. Under the interpreter, bf16 dot operands are therefore
converted to float32 first (bf16 <-> fp32 casts are emulated correctly). The rounding points
are unchanged, since a bf16 value converts to fp32 exactly: only the accumulation order of
the product differs from the GPU path, where the operands stay bf16 on the tensor cores.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_flags(dtype: torch.dtype) -> dict[str, object]:
    """Compile-time flags for :func:`dot`: exact fp32 (no TF32), and the interpreter upcast."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else None,
        "DOT_UPCAST": interpreting() and dtype == torch.bfloat16,
    }


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)
