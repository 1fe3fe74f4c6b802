"""Time every hybridllm kernel against its torch reference and, for attention, SDPA.

    uv run python bench/kernels/run.py            # full sweep (GPU), writes bench/results/
    uv run python bench/kernels/run.py --quick    # a few shapes per kernel

On a CUDA device the Triton kernels are timed with CUDA events (L2 flushed before each
repetition, median of ``--reps``) and every time is also given as achieved bandwidth and as
a fraction of the GPU's peak HBM bandwidth (decode attention is memory-bound: that fraction
is its figure of merit; the goal is >= 80% at context >= 4k, batch >= 32 on H100/H200).
Without a CUDA device it says so, times only the torch references and their peers (SDPA)
at small shapes so the command is exercised, and exits 0: the GPU figures stay open.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cases
import torch

ROOT = Path(__file__).resolve().parents[2]

# Peak HBM bandwidth in GB/s, from the vendors' data sheets, by device-name pattern.
PEAK_GBPS = [
    (r"H200", 4800.0),
    (r"GH200", 4000.0),
    (r"H100.*NVL", 3900.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100", 3350.0),
    (r"A100.*80GB", 2039.0),
    (r"A100", 1555.0),
    (r"L40S", 864.0),
    (r"L4", 300.0),
]


def peak_gbps(device_name: str) -> float | None:
    for pattern, gbps in PEAK_GBPS:
        if re.search(pattern, device_name):
            return gbps
    return None


def time_cuda(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds over ``reps`` runs, L2 flushed before each."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(reps: int) -> float:
    """What a plain device-to-device copy achieves: a practical ceiling next to the spec."""
    src = torch.empty(1024 * 1024 * 1024, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), reps)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def machine() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration) as exc:
        print(f"could not read /proc for the machine description: {exc}", file=sys.stderr)
        mem_kb = 0
    info: dict[str, object] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        import triton

        info["gpu"] = torch.cuda.get_device_name()
        info["triton"] = triton.__version__
    return info


def build_cases(
    on_gpu: bool, quick: bool, triton_ops, dtype: torch.dtype, tune: bool = False
) -> list[cases.Case]:
    device = "cuda" if on_gpu else "cpu"
    built: list[cases.Case] = []
    if on_gpu:
        # Llama-3-8B-like attention: 32 query heads over 8 KV heads, head_dim 128.
        batches = [1, 32, 64] if quick else [1, 8, 32, 64, 128]
        contexts = [1024, 4096] if quick else [512, 1024, 4096, 8192, 16384, 32768]
        free = torch.cuda.mem_get_info()[0]
        for batch in batches:
            for context in contexts:
                kv_bytes = 2 * batch * context * 8 * 128 * 2
                if 3 * kv_bytes > 0.8 * free:
                    continue
                with_ref = 8 * kv_bytes < 0.4 * free  # the reference gathers fp32 copies
                built.append(
                    cases.decode_case(
                        batch, context, 32, 8, 128, 16, dtype, device, triton_ops, with_ref, tune
                    )
                )
        for batch, q_len, prefix in (
            [(1, 2048, 0), (4, 512, 2048), (8, 1024, 0)] if not quick else [(4, 512, 2048)]
        ):
            built.append(
                cases.prefill_case(
                    batch, q_len, prefix, 32, 8, 128, 16, dtype, device, triton_ops, True
                )
            )
        for tokens in [1, 64, 4096] if not quick else [64]:
            built.extend(cases.pointwise_cases(tokens, 4096, 14336, dtype, device, triton_ops))
        for m in [1, 16, 64, 256] if not quick else [16]:
            built.append(cases.w8a16_case(m, 14336, 4096, dtype, device, triton_ops))
    else:
        # SmolLM2-135M shapes (9 query heads over 3 KV heads, head_dim 64), what CPU engines run.
        for batch in [1, 8]:
            for context in [256, 1024] if quick else [256, 1024, 4096]:
                built.append(
                    cases.decode_case(batch, context, 9, 3, 64, 16, dtype, device, None, True)
                )
        built.append(cases.prefill_case(2, 128, 256, 9, 3, 64, 16, dtype, device, None, True))
        built.extend(cases.pointwise_cases(64, 576, 1536, dtype, device, None))
        built.append(cases.w8a16_case(8, 1536, 576, dtype, device, None))
    return built


def run(args: argparse.Namespace) -> int:
    on_gpu = torch.cuda.is_available()
    info = machine()
    triton_ops = None
    peak = None
    if on_gpu:
        from hybridllm_kernels import triton_ops as loaded

        triton_ops = loaded
        peak = args.peak_gbps or peak_gbps(str(info["gpu"]))
        info["peak_gbps"] = peak
        info["copy_gbps"] = round(copy_bandwidth_gbps(args.reps), 1)
        dtype = torch.bfloat16
        timer = time_cuda
    else:
        print(
            "no CUDA device: the Triton kernels are not timed (the GPU figures stay open); "
            "timing the torch references and SDPA on CPU only"
        )
        dtype = torch.float32
        timer = time_cpu
        # One thread: on a small shared machine, intra-op threads only add scheduling noise.
        torch.set_num_threads(1)
    rows = []
    for case in build_cases(on_gpu, args.quick, triton_ops, dtype, args.tune):
        times = {}
        for name, fn in case.impls.items():
            try:
                times[name] = timer(fn, args.reps)
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                print(
                    f"{case.kernel} {case.params} {name}: failed, not timed: {exc}", file=sys.stderr
                )
        peer = "sdpa" if "sdpa" in times else "torch_matmul_16bit"
        for name, ms in times.items():
            gbps = case.bytes_moved / (ms * 1e-3) / 1e9
            row = {
                "kernel": case.kernel,
                **{f"p_{k}": v for k, v in case.params.items()},
                "params": case.params,
                "impl": name,
                "median_ms": round(ms, 4),
                "gbps": round(gbps, 1),
                "frac_peak": round(gbps / peak, 3) if peak else None,
                "vs_triton": round(ms / times["triton"], 2) if "triton" in times else None,
                "vs_peer": round(ms / times[peer], 2) if peer in times else None,
            }
            rows.append(row)
            print(
                f"{case.kernel:24s} {json.dumps(case.params):60s} {name:18s} {ms:9.4f} ms "
                f"{gbps:8.1f} GB/s" + (f" {gbps / peak:6.1%} of peak" if peak else "")
            )
    command = "uv run python bench/kernels/run.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_results(rows, info, command.strip(), args, on_gpu)
    return 0


def goal_line(rows: list[dict]) -> str:
    cells = [
        r
        for r in rows
        if r["kernel"] == "paged_decode_attention"
        and r["impl"] == "triton"
        and r["params"]["context"] >= 4096
        and r["params"]["batch"] >= 32
    ]
    if not cells or cells[0]["frac_peak"] is None:
        return "Goal (decode >= 80% of peak at context >= 4k, batch >= 32): not measured."
    worst = min(r["frac_peak"] for r in cells)
    verdict = "met" if worst >= 0.8 else "not met"
    return (
        "Goal (decode >= 80% of peak HBM bandwidth at context >= 4k, batch >= 32): "
        f"{verdict}; worst cell {worst:.1%}."
    )


def write_results(
    rows: list[dict], info: dict, command: str, args: argparse.Namespace, on_gpu: bool
) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", str(info.get("gpu", "cpu")).lower()).strip("-")
    stem = out_dir / f"kernels-{slug}{'-quick' if args.quick else ''}"
    (stem.with_suffix(".json")).write_text(
        json.dumps({"machine": info, "command": command, "rows": rows}, indent=1)
    )
    lines = [
        f"# Kernel benchmarks: {info.get('gpu', 'CPU only (no CUDA device)')}",
        "",
        f"- Command: `{command}`",
        f"- Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM"
        + (
            f"; GPU {info['gpu']}, peak {info['peak_gbps']} GB/s (spec), "
            f"device copy {info['copy_gbps']} GB/s"
            if on_gpu
            else ""
        ),
        f"- Versions: torch {info['torch']}" + (f", triton {info['triton']}" if on_gpu else ""),
        f"- Medians over {args.reps} repetitions"
        + (", L2 flushed before each (CUDA events)." if on_gpu else " (perf_counter)."),
        "- `vs_triton` = this time / Triton time (above 1: Triton is faster); `vs_peer` = this",
        "  time / the peer's (SDPA on contiguous K/V for attention, a 16-bit matmul for W8A16);",
        "  both from the same run. The machine may be shared: compare ratios, not times.",
        "",
    ]
    if on_gpu:
        lines += [goal_line(rows), ""]
    else:
        lines += [
            "No CUDA device: the Triton kernels were not timed; the GPU figures are open.",
            "These rows time the torch references (the engine's CPU path), with SDPA on",
            "contiguous K/V (and a 16-bit matmul for W8A16) as the peers.",
            "",
        ]
    lines += [
        "| kernel | shape | impl | median ms | GB/s | of peak | vs triton | vs peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        frac = f"{r['frac_peak']:.1%}" if r["frac_peak"] is not None else "-"
        vs = r["vs_triton"] if r["vs_triton"] is not None else "-"
        vs_peer = r["vs_peer"] if r["vs_peer"] is not None else "-"
        lines.append(
            f"| {r['kernel']} | {shape} | {r['impl']} | {r['median_ms']} | {r['gbps']} "
            f"| {frac} | {vs} | {vs_peer} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, stem.with_suffix(".png"), on_gpu, str(info.get("gpu", "CPU")))
    print(f"wrote {stem}.md, .json, .png")


def plot(rows: list[dict], path: Path, on_gpu: bool, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"matplotlib unavailable, no plot: {exc}", file=sys.stderr)
        return
    decode = [r for r in rows if r["kernel"] == "paged_decode_attention"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in sorted({r["impl"] for r in decode}):
        for batch in sorted({r["params"]["batch"] for r in decode}):
            pts = sorted(
                (r["params"]["context"], r["frac_peak"] if on_gpu else r["median_ms"])
                for r in decode
                if r["impl"] == impl and r["params"]["batch"] == batch
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{impl}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    if on_gpu:
        ax.set_ylabel("fraction of peak HBM bandwidth")
        ax.axhline(0.8, color="grey", linestyle="--", label="goal 80%")
    else:
        ax.set_yscale("log")
        ax.set_ylabel("median time (ms)")
    ax.set_title(f"paged decode attention: {title}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes per kernel")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per measurement (median)")
    parser.add_argument(
        "--peak-gbps", type=float, default=None, help="override the GPU's peak bandwidth"
    )
    parser.add_argument(
        "--tune", action="store_true", help="also time decode at every (tile_n, num_warps)"
    )
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
