"""How much can batching gain at all? llama.cpp decode-step cost against the batch size.

One command (from the repository root)::

    uv run --no-sync python bench/edge/scaling.py --out bench/results/edge-scaling

A server that runs one request at a time (``python -m llama_cpp.server``) decodes at the
batch-1 rate; a batched server (ours) at best at the batch-8 rate. So, before any serving
overhead, ``tok/s(batch 8) / tok/s(batch 1)`` of one ``llama_decode`` is the ceiling of the
8-client throughput ratio on this machine. It depends on the weight type's CPU kernel:

- Q4_1 (the shipped GGUF): ggml has neither a llamafile ``tinyBLAS`` kernel nor a repacked
  layout for it on x86, so each of the B columns is a separate ``ggml_vec_dot_q4_1_q8_1``
  over the whole weight row (``type_traits_cpu[Q4_1].nrows = 1`` without ARM int8 matmul):
  the unpacking work is repeated per sequence and the step cost grows almost linearly
  with B.
- Q8_0, Q4_0 and F16 have kernels that reuse a loaded weight tile across columns
  (``tinyBLAS`` for Q8_0/Q4_0/F16, the 8x8 repack for Q4_0): there the step is closer to
  memory-bound and batching pays.

The weight types are the model store's conversions of the same model (``gguf-q8_0``,
``gguf-q4_k_m``, ``gguf-q4_0``, ``gguf-f16``; ``bench/edge/weights.py``). Q4_K_M (the
``LLMService`` edge default) is mostly Q5_0 and Q8_0 on this model: its 576-wide rows are
not multiples of 256, so llama.cpp's quantizer falls back for those tensors. Every
round measures every type at every batch size, interleaved, so load from other users of
a shared machine falls on all alike; the report gives medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weights
from run import PROMPTS, ROOT, machine


def step_ms(backend: Any, batch: int, steps: int) -> float:
    """Median wall time of one decode step of ``batch`` sequences (after their prefill)."""
    from hybridllm_edge.backends.base import SlotWork

    pos = []
    for slot in range(batch):
        prompt = backend.encode(PROMPTS[slot % len(PROMPTS)], True)
        backend.forward([SlotWork(slot, prompt, 0, True)])
        pos.append(len(prompt))
    times = []
    for i in range(steps):
        work = [SlotWork(s, [1000 + s + i], pos[s] + i, True) for s in range(batch)]
        t0 = time.perf_counter()
        backend.forward(work)
        times.append(time.perf_counter() - t0)
    for slot in range(batch):
        backend.release(slot)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/edge-scaling")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()

    from hybridllm_edge import config
    from hybridllm_edge.backends.llamacpp import LlamaCppBackend

    labels = {
        "q4_1": "Q4_1 (shipped)",
        "q8_0": "Q8_0",
        "q4_k_m": "Q4_K_M",
        "q4_0": "Q4_0",
        "f16": "F16",
    }
    models = {labels[w]: weights.resolve(w) for w in weights.CHOICES}
    settings = config.EdgeSettings(parallel=max(args.batches), threads=args.threads,
                                   max_model_len=256)  # fmt: skip
    backends = {name: LlamaCppBackend(path, name, settings) for name, path in models.items()}
    report: dict[str, Any] = {
        "machine": machine(), "command": " ".join(sys.argv), "threads": args.threads,
        "steps": args.steps, "rounds": args.rounds,
        "models": {name: str(path) for name, path in models.items()},
    }  # fmt: skip
    runs: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batches} for n in models}
    for r in range(args.rounds):
        for name, backend in backends.items():
            for b in args.batches:
                runs[name][b].append(step_ms(backend, b, args.steps))
            row = ", ".join(f"b{b} {runs[name][b][-1]:.1f} ms" for b in args.batches)
            print(f"round {r} {name}: {row}", flush=True)
    for backend in backends.values():
        backend.close()
    report["load_end"] = list(machine()["load"])
    report["results"] = {
        name: {
            str(b): {
                "step_ms": statistics.median(ms),
                "tokens_per_s": statistics.median(1000 * b / m for m in ms),
                # per round: tok/s at b over tok/s at 1, measured moments apart
                "gain_vs_batch1": statistics.median(
                    (b / m) / (1 / m1) for m, m1 in zip(ms, per_b[1], strict=True)
                ),
                "runs_ms": ms,
            }
            for b, ms in per_b.items()
        }
        for name, per_b in runs.items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    from plot import plot_scaling, write_scaling_markdown  # bench/edge/plot.py

    plot_scaling(report, Path(f"{args.out}.png"))
    write_scaling_markdown(report, Path(f"{args.out}.md"))
    print(Path(f"{args.out}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
