"""Every Triton kernel compiles for sm_90 (H100/H200), checked on a machine without a GPU.

The interpreter tests check what the kernels compute; this checks that the NVIDIA backend
accepts them (down to a cubin, with Triton's bundled ptxas) at engine shapes. It runs in a
fresh process because the conftest turns the interpreter on for this one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

KERNELS = [
    "_decode_kernel",
    "_combine_kernel",
    "_prefill_kernel",
    "_write_kv_kernel",
    "_rotary_kernel",
    "_rms_norm_kernel",
    "_silu_and_mul_kernel",
    "_w8a16_kernel",
]


@pytest.mark.slow
def test_all_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "hybridllm_kernels.aot", "--quick", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    assert compiled == set(KERNELS), result.stdout
