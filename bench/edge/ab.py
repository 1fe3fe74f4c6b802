"""Our server at two commits, same GGUF, alternating 8-client load rounds: what a change bought.

    uv run --no-sync python bench/edge/ab.py --before 1cbe0ff [--out ab.json]

A tool for a change's notes, not a tracked experiment: it prints the comparison and writes
JSON only where ``--out`` says (``bench/results/`` holds the current experiments).

The ``--before`` commit's ``runtime-edge/src`` is checked out into a temporary git
worktree and put first on that server's PYTHONPATH; the other server runs the working
tree. Both use the same GGUF, threads and slots; rounds alternate before/after.
``--lengths 16 48 96`` gives the requests different ``max_tokens`` (client c's request i
gets ``lengths[(3 c + i) % len]``), so slots are freed and refilled out of order as in real
traffic; without it every request asks for ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import weights
from run import PROMPTS, ROOT, completion, free_port, load_test, machine, start, stop


def mixed_load(base: str, clients: int, per_client: int, lengths: list[int]) -> dict[str, float]:
    def client(c: int) -> int:
        return sum(
            int(completion(base, PROMPTS[(c + i) % len(PROMPTS)],
                           lengths[(3 * c + i) % len(lengths)])["tokens"])
            for i in range(per_client)
        )  # fmt: skip

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(client, range(clients)))
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "output_tokens": tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--before", required=True, help="git commit to compare against")
    parser.add_argument("--weights", choices=weights.CHOICES, default="q4_1")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lengths", type=int, nargs="+", help="mixed max_tokens per request")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    gguf = str(weights.resolve(args.weights))
    tree = Path(tempfile.mkdtemp(prefix="edge-ab-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.before],
                   check=True, capture_output=True)  # fmt: skip
    report = {"machine": machine(), "command": " ".join(sys.argv), "gguf": gguf,
              "before": args.before, "clients": args.clients, "max_tokens": args.max_tokens,
              "lengths": args.lengths, "per_client": args.per_client}  # fmt: skip
    procs = []
    try:
        bases = {}
        for name, path in (("before", tree / "runtime-edge/src"), ("after", None)):
            port = free_port()
            env = dict(os.environ)
            if path is not None:
                env["PYTHONPATH"] = f"{path}{os.pathsep}{env.get('PYTHONPATH', '')}"
            cmd = [sys.executable, "-m", "hybridllm_edge.cli", "serve", "--model", gguf,
                   "--parallel", "8", "--threads", "1", "--max-model-len", "1024",
                   "--port", str(port), "--host", "127.0.0.1"]  # fmt: skip
            procs.append(start(cmd, port, env))
            bases[name] = f"http://127.0.0.1:{port}"
        runs: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(args.rounds):
            for name, base in bases.items():
                if args.lengths:
                    res = mixed_load(base, args.clients, args.per_client, args.lengths)
                else:
                    res = load_test(base, args.clients, args.per_client, args.max_tokens)
                runs[name].append(res["tokens_per_s"])
                print(f"round {r} {name}: {res['tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        for p in procs:
            stop(p)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False)  # fmt: skip
    report["load_end"] = list(os.getloadavg())
    report["tokens_per_s"] = runs
    report["after_over_before"] = statistics.median(
        a / b for a, b in zip(runs["after"], runs["before"], strict=True)
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
