"""Compile every Triton kernel for a GPU target on a machine without a GPU.

CI has no GPU, and Triton's interpreter checks what a kernel computes but not whether it
compiles: a kernel can pass every interpreter test and still fail in the NVIDIA backend
(types, layouts, shared memory). Triton compiles ahead of time given a target, and its
wheel ships ptxas, so this module drives each launcher in ``triton_ops`` at engine-sized
shapes with CPU tensors, records the launch instead of running it (each kernel is swapped
for a recorder for the duration), and compiles the recorded launch for ``sm_90``
(H100/H200) down to a cubin. Argument specialisation mimics Triton's own: pointers and
ints divisible by 16 get the divisibility hint, ints equal to 1 become constants.

Run it with ``TRITON_INTERPRET`` unset (the kernels must be real ``JITFunction`` objects):

    uv run python -m hybridllm_kernels.aot          # exit 1 if any kernel fails to compile
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

_DTYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
}
_OPTIONS = ("num_warps", "num_stages")


@dataclass
class Launch:
    kernel: Any  # triton JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class _Recorder:
    def __init__(self, kernel: Any, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return record


@contextlib.contextmanager
def recording(modules: list[ModuleType]) -> Iterator[list[Launch]]:
    """Within the block, ``kernel[grid](...)`` in these modules records instead of running."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    swapped = []
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                swapped.append((module, name, value))
                setattr(module, name, _Recorder(value, launches))
    try:
        yield launches
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def compile_launch(launch: Launch, arch: int = 90) -> Any:
    """Compile one recorded launch for ``cuda:sm_<arch>``; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    values = dict(zip(names, launch.args, strict=False))
    values.update({k: v for k, v in launch.kwargs.items() if k not in _OPTIONS})
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        value = values[name]
        if i in launch.kernel.constexprs or value is None or isinstance(value, bool):
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}: cannot type argument {name}={value!r}")
    options = {k: v for k, v in launch.kwargs.items() if k in _OPTIONS}
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def engine_launches(quick: bool = False) -> list[Launch]:
    """Every launcher at the shapes the engine runs (Llama-8B-like, SmolLM2-like, head_dim
    256, float32); ``quick``: bf16 Llama-8B-like attention and the pointwise kernels only."""
    from hybridllm_kernels import reference, triton_ops
    from hybridllm_kernels.testing import make_paged_kv
    from hybridllm_kernels.triton_ops import (
        activation,
        decode_attention,
        kv_cache,
        norm,
        prefill_attention,
        rotary,
        w8a16,
    )

    modules = [activation, decode_attention, kv_cache, norm, prefill_attention, rotary, w8a16]
    bf16 = torch.bfloat16
    with recording(modules) as launches:
        attention_shapes = [(32, 8, 128, bf16), (9, 3, 64, bf16), (8, 4, 256, bf16)]
        attention_shapes += [(32, 8, 128, torch.float32)]
        for heads, kv_heads, head_dim, dtype in attention_shapes[: 1 if quick else None]:
            kv = make_paged_kv([40, 70], kv_heads, head_dim, 16, dtype)
            q = torch.randn(2, heads, head_dim).to(dtype)
            args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.1)
            triton_ops.paged_decode_attention(*args)  # one pass
            triton_ops.paged_decode_attention(*args, 7, partition_size=64)  # split-K + window
            qp = torch.randn(9, heads, head_dim).to(dtype)
            qsl = torch.tensor([0, 4, 9], dtype=torch.int32)
            triton_ops.paged_prefill_attention(
                qp, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.1
            )
            triton_ops.paged_prefill_attention(
                qp, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.context_lens, 0.1, 7
            )
            triton_ops.write_kv(
                qp[:, :kv_heads], qp[:, :kv_heads], kv.k_cache, kv.v_cache, torch.arange(9)
            )
            cache = torch.randn(100, head_dim).to(dtype)
            triton_ops.rotary_embedding(torch.arange(9), qp, qp[:, :kv_heads], cache)
            triton_ops.rotary_embedding(torch.arange(9), qp, qp[:, :kv_heads], cache, is_neox=False)
        for hidden, dtype in [(4096, bf16), (576, bf16), (4096, torch.float32)][
            : 1 if quick else None
        ]:
            x = torch.randn(3, hidden).to(dtype)
            triton_ops.rms_norm(x, x[0], 1e-6)
            triton_ops.fused_add_rms_norm(x, x, x[0], 1e-6)
            triton_ops.silu_and_mul(x)
        w_int8, scales = reference.quantize_per_channel_int8(torch.randn(256, 512))
        for m, dtype in [
            (1, bf16),
            (40, bf16),
            (300, bf16),
            (20, torch.float16),
            (20, torch.float32),
        ]:
            x = torch.randn(m, 512).to(dtype)
            triton_ops.w8a16_matmul(x, w_int8, scales, torch.randn(256))
            triton_ops.w8a16_matmul(x, w_int8, scales)
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile every Triton kernel for a GPU target")
    parser.add_argument(
        "--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)"
    )
    parser.add_argument("--quick", action="store_true", help="one shape per kernel family")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels that are compiled here")
        return 2
    failures = 0
    for launch in engine_launches(args.quick):
        name = launch.kernel.__name__
        consts = {k: v for k, v in launch.kwargs.items() if k.isupper()}
        t0 = time.perf_counter()
        try:
            compiled = compile_launch(launch, args.arch)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail once
            failures += 1
            print(f"FAIL {name} {consts}: {type(exc).__name__}: {exc}")
            continue
        print(
            f"ok   {name} {consts} sm_{args.arch}: shared {compiled.metadata.shared} B, "
            f"{time.perf_counter() - t0:.1f}s"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
