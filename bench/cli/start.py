"""How long `hybridllm` takes to answer the commands a user types to find their way and to
look at a running service: the wall time of each, in a fresh process, medians of repeats.

Commands (#55): `hybridllm --help`, `hybridllm COMMAND --help` for every command, and
`status`, `logs`, `down`, `rollout status` (against a state folder with no service: they
read it and say so, which is what they do before any service is up). Beside them, on the
same machine in the same run:

- the interpreter's floor: `python -c pass` and `python -c "import pydantic"` (every
  command parses its flags with pydantic models), which no command can beat;
- the peers a platform team types beside ours: `kubectl --help` and `helm --help` (Go
  binaries, from the test control plane's cache when present, else skipped).

Goal (#55): every command under 1 s of wall time on the 2-core machine when it is
otherwise quiet.

Usage: uv run python bench/cli/start.py [--repeats 7] [--out bench/results/cli-start]
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "common" / "src"))

from hybridllm_common import cli  # noqa: E402

GOAL_S = 1.0
HYBRIDLLM = [sys.executable, "-m", "hybridllm_common.cli"]


def commands() -> dict[str, list[str]]:
    out = {"hybridllm --help": [*HYBRIDLLM, "--help"]}
    for name in cli.COMMANDS:
        out[f"hybridllm {name} --help"] = [*HYBRIDLLM, name, "--help"]
    out["hybridllm status"] = [*HYBRIDLLM, "status"]
    out["hybridllm logs"] = [*HYBRIDLLM, "logs"]
    out["hybridllm down"] = [*HYBRIDLLM, "down"]
    out["hybridllm rollout status --local"] = [*HYBRIDLLM, "rollout", "status", "svc", "--local"]
    return out


def floors() -> dict[str, list[str]]:
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import pydantic'": [sys.executable, "-c", "import pydantic"],
    }


def peers() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    cache = Path.home() / ".cache" / "hybridllm" / "testenv"
    for tool in ("kubectl", "helm"):
        path = shutil.which(tool) or next(iter(sorted(cache.glob(f"*/bin/{tool}"))), None)
        if path:
            found[f"{tool} --help"] = [str(path), "--help"]
    return found


def wall(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cli-start")
    args = parser.parse_args()
    groups = {"hybridllm": commands(), "floor": floors(), "peer": peers()}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "XDG_STATE_HOME": state}  # no local service: nothing to find
        for group, table in groups.items():
            for label, argv in table.items():
                wall(argv, env)  # one warm-up: the page cache, as for a user's second try
                times = [wall(argv, env) for _ in range(args.repeats)]
                rows.append({"group": group, "command": label, "median_s": statistics.median(times),
                             "max_s": max(times), "runs": len(times)})  # fmt: skip
                print(f"{label:40s} {statistics.median(times):6.3f} s", flush=True)
    ours = [r for r in rows if r["group"] == "hybridllm"]
    slowest = max(ours, key=lambda r: float(r["median_s"]))
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": "uv run python bench/cli/start.py " + f"--repeats {args.repeats}",
        "goal_s": GOAL_S,
        "repeats": args.repeats,
        "rows": rows,
        "slowest": slowest,
        "all_under_goal": all(float(r["median_s"]) < GOAL_S for r in ours),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# `hybridllm` start-up: the commands a user types first",
        "",
        f"Machine: {result['machine']}. Command: `{result['command']}`. Each command in a "
        "fresh process, one warm-up then the median of the repeats, wall time; a state "
        "folder with no service in it. Goal (#55): every command under "
        f"{GOAL_S:.0f} s.",
        "",
        "| group | command | median | max |",
        "|---|---|---|---|",
        *(f"| {r['group']} | `{r['command']}` | {float(r['median_s']):.3f} s | "
          f"{float(r['max_s']):.3f} s |" for r in rows),
        "",
        f"Slowest of ours: `{slowest['command']}`, {float(slowest['median_s']):.3f} s "
        f"({'every command under the goal' if result['all_under_goal'] else 'over the goal'}).",
        "",
    ]  # fmt: skip
    args.out.with_suffix(".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
