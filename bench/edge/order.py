"""What slot order costs llama.cpp with a per-sequence KV: one decode step of 8 sequences.

    uv run --no-sync python bench/edge/order.py --out bench/results/edge-order.json

``LlamaCppBackend.forward`` always packs a step in slot order, so this script fills the
backend's ``llama_batch`` itself in a chosen order and times ``llama_decode``: slot order
(one micro-batch), 3,0,5,1,2,4,6,7 (three: {3,4}, {0,1,2}, {5,6,7}) and 7..0 (eight).
Orders alternate within each round; medians over rounds of per-order medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weights
from run import PROMPTS, ROOT, machine

ORDERS = {"slot order": [0, 1, 2, 3, 4, 5, 6, 7], "3,0,5,1,2,4,6,7": [3, 0, 5, 1, 2, 4, 6, 7],
          "reversed": [7, 6, 5, 4, 3, 2, 1, 0]}  # fmt: skip


def decode_ms(backend: Any, order: list[int], steps: int) -> float:
    import llama_cpp

    from hybridllm_edge.backends.base import SlotWork

    for slot in range(8):
        backend.release(slot)
    pos = {}
    for slot in order:
        prompt = backend.encode(PROMPTS[slot], True)
        backend.forward([SlotWork(slot, prompt, 0, True)])
        pos[slot] = len(prompt)
    batch, ctx = backend._batch, backend._ctx.ctx
    times = []
    for i in range(steps):
        for n, slot in enumerate(order):
            batch.token[n], batch.pos[n] = 1000 + slot + i, pos[slot] + i
            batch.n_seq_id[n], batch.seq_id[n][0], batch.logits[n] = 1, slot, True
        batch.n_tokens = len(order)
        t0 = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        times.append(time.perf_counter() - t0)
    for slot in range(8):
        backend.release(slot)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--weights", nargs="+", choices=weights.CHOICES, default=["q4_1", "f16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/edge-order.json")
    args = parser.parse_args()

    from hybridllm_edge import config
    from hybridllm_edge.backends.llamacpp import LlamaCppBackend

    settings = config.EdgeSettings(parallel=8, threads=1, max_model_len=256)
    backends = {w: LlamaCppBackend(weights.resolve(w), w, settings) for w in args.weights}
    report: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv)}
    runs = {w: {o: [] for o in ORDERS} for w in backends}
    for r in range(args.rounds):
        for w, backend in backends.items():
            for name, order in ORDERS.items():
                runs[w][name].append(decode_ms(backend, order, args.steps))
            print(f"round {r} {w}: " + ", ".join(f"{o} {v[-1]:.1f} ms" for o, v in runs[w].items()),
                  flush=True)  # fmt: skip
    report["load_end"] = list(os.getloadavg())
    report["step_ms"] = {
        w: {o: statistics.median(v) for o, v in per.items()} for w, per in runs.items()
    }
    report["over_slot_order"] = {
        w: {o: statistics.median(a / b for a, b in zip(v, per["slot order"], strict=True))
            for o, v in per.items()}
        for w, per in runs.items()
    }  # fmt: skip
    report["runs_ms"] = runs
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("step_ms", "over_slot_order")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
