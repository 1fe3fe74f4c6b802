"""What the benchmarks on a local control plane share: hack/testenv, and a process's CPU
time and memory from /proc."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def testenv() -> Any:
    """hack/testenv/cluster.py as a module (``up(state_dir)``, ``down(state_dir)``)."""
    spec = importlib.util.spec_from_file_location("testenv", ROOT / "hack/testenv/cluster.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["testenv"] = module
    spec.loader.exec_module(module)
    return module


def proc_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mem_mb(pid: int, field: str) -> float:
    """A memory field of /proc/PID/status (VmRSS, VmHWM) in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")
