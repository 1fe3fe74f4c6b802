"""Which int8 ONNX recipe: every onnxruntime int8 option on this CPU, against ONNX fp32.

    uv run python bench/models/int8_options.py     # writes bench/results/models-int8-options.{md,json}

onnxruntime's dynamic int8 MatMul multiplies u8 activations by s8 weights with
``vpmaddubsw`` on x86 CPUs without VNNI, whose 16-bit intermediate sums saturate; its
quantization guide names the ways out: 7-bit weights (``reduce_range``), u8 weights (U8U8),
or weight-only quantization (``MatMulNBits``, activations stay fp32). Each option is built
from the store's fp32 ONNX export and measured in one run, with ONNX fp32 as the peer:

- KL divergence and top-1 agreement against the fp32 reference on the quality-check
  prompts (``hybridllm_models.quality``, what a runtime checks at load);
- perplexity on bench/data/perplexity.txt (512-token windows);
- file size and single-stream decode tokens/s (1 thread, median over prompts).

The CPU's int8 instructions are printed with the results: the same file gives other
numbers on a CPU with VNNI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hybridllm_models
from hybridllm_models import onnx_export, quality
from hybridllm_models.onnx_runner import OnnxCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality as formats

ROOT = Path(__file__).resolve().parents[2]


def _dynamic(**options: Any) -> Callable[[Path, Path], None]:
    def build(src: Path, dst: Path) -> None:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(
            src / onnx_export.MODEL_FILE,
            dst / onnx_export.MODEL_FILE,
            weight_type=options.pop("weight_type", QuantType.QInt8),
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            extra_options={"MatMulConstBOnly": True},
            **options,
        )

    return build


def _weight_only(block_size: int, accuracy_level: int | None) -> Callable[[Path, Path], None]:
    def build(src: Path, dst: Path) -> None:
        onnx_export.quantize_weight_only(src, dst, block_size, accuracy_level)

    return build


def options() -> list[tuple[str, str, Callable[[Path, Path], None] | None]]:
    from onnxruntime.quantization import QuantType

    return [
        ("fp32 (peer)", "the store's fp32 export", None),
        ("dynamic U8S8", "quantize_dynamic, s8 per-channel weights (the old recipe)", _dynamic()),
        (
            "dynamic U8S8 reduce_range",
            "quantize_dynamic, 7-bit s8 per-channel weights",
            _dynamic(reduce_range=True),
        ),
        (
            "dynamic U8U8",
            "quantize_dynamic, u8 per-channel weights",
            _dynamic(weight_type=QuantType.QUInt8),
        ),
        (
            "weight-only int8, block 32",
            "MatMulNBits bits=8, symmetric, fp32 activations",
            _weight_only(32, None),
        ),
        (
            "weight-only int8, block 128",
            "MatMulNBits bits=8, symmetric, fp32 activations",
            _weight_only(128, None),
        ),
        (
            "weight-only int8, block 32, int8 compute",
            "MatMulNBits bits=8, accuracy_level 4 (activations int8 per block)",
            _weight_only(32, 4),
        ),
        (
            "weight-only int8, block 128, int8 compute",
            "MatMulNBits bits=8, accuracy_level 4 (activations int8 per block)",
            _weight_only(128, 4),
        ),
    ]


def cpu_int8_flags() -> str:
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")
    return ", ".join(f"{w}={'yes' if w in flags else 'no'}" for w in wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts for decode speed")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/models-int8-options")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)

    from tokenizers import Tokenizer

    reference = hybridllm_models.ensure_artifact(target="onnx").manifest.reference
    assert reference is not None, "the onnx artifact has no reference outputs; rebuild it"
    fp32_dir = hybridllm_models.ensure(target="onnx")
    tokenizer = Tokenizer.from_file(str(fp32_dir / "tokenizer.json"))
    text_ids = tokenizer.encode(formats.TEXT.read_text(), add_special_tokens=False).ids
    chats = [
        tokenizer.encode(
            f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        ).ids
        for p in formats.PROMPTS[: args.prompts]
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, how, build in options():
            folder = fp32_dir
            if build is not None:
                folder = Path(tmp) / label.replace(" ", "_").replace(",", "")
                folder.mkdir()
                build(fp32_dir, folder)
                for name in onnx_export.SIDE_FILES:
                    if (fp32_dir / name).is_file():
                        shutil.copyfile(fp32_dir / name, folder / name)
            backend = formats.OnnxBackend(folder)
            backend.load()
            model: OnnxCausalLM = backend.model
            result = quality.compare(
                reference,
                [model.forward(list(p), model.empty_past())[0] for p in reference.prompts],
            )
            rates = [backend.greedy(ids, args.tokens)[1] for ids in chats]
            row = {
                "option": label,
                "how": how,
                "kl": result.mean_kl,
                "top1": result.top1,
                "positions": result.num_positions,
                "perplexity": formats.perplexity(backend, text_ids),
                "file_mb": (folder / onnx_export.MODEL_FILE).stat().st_size / 1e6,
                "tokens_per_s": statistics.median(rates),
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    write(args, rows)
    return 0


def write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    command = "uv run python bench/models/int8_options.py " + " ".join(
        f"--prompts {args.prompts} --tokens {args.tokens}".split()
    )
    meta = {
        "machine": formats.machine(),
        "cpu_int8": cpu_int8_flags(),
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "peer": base["option"],
    }
    out: Path = args.out
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# ONNX int8 recipes on this CPU (SmolLM2-135M-Instruct)",
        "",
        f"- Machine: {meta['machine']}; int8 instructions: {meta['cpu_int8']}",
        f"- Command: `{command}`",
        f"- Date: {meta['date']}",
        "- KL / top-1: against the fp32 reference on the quality-check prompts "
        f"({base['positions']} positions, `hybridllm_models.quality`).",
        "- Perplexity: `bench/data/perplexity.txt`, 512-token windows. Speed: single stream, "
        f"1 thread, {args.prompts} chat prompts x {args.tokens} tokens, median. Peer: ONNX fp32 "
        "(onnxruntime, CPU provider, 1 intra-op thread), same run.",
        "",
        "| recipe | how | KL (nats) | top-1 | perplexity | vs fp32 | file MB | tokens/s | "
        "vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['option']} | {r['how']} | {r['kl']:.4f} | {r['top1']:.1%} | "
            f"{r['perplexity']:.2f} | {r['perplexity'] / base['perplexity']:.3f}x | "
            f"{r['file_mb']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
