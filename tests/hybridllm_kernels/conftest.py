"""Shared fixtures for the kernel tests.

Without a CUDA device the Triton kernels run under Triton's interpreter, which must be
switched on before any kernel module is decorated with ``triton.jit``; this conftest is
imported before the test modules, so it sets ``TRITON_INTERPRET=1`` here. Tests that need
the Triton path call ``hybridllm_kernels.triton_ops`` directly (the dispatch default on CPU
is torch) at tiny shapes, since the interpreter executes every program in Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tolerances per dtype, for outputs of O(1) magnitude. float32 kernels differ from the
# reference only in summation order and online-softmax rescaling; bfloat16 has an 8-bit
# mantissa (one ulp at 1.0 is 2**-7 = 0.0078), and the kernels round at other points than
# the reference (P is cast to bf16 before P @ V), so a few ulps are allowed; float16
# (11-bit mantissa, ulp at 1.0 = 0.001) likewise, on the GPU tests only.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}

CheckClose = Callable[[torch.Tensor, torch.Tensor], None]


def _check_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[expected.dtype])


@pytest.fixture
def check_close() -> CheckClose:
    """Compares a kernel's output with the reference's under the dtype's tolerance."""
    return _check_close


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
