"""Where a local service keeps its state, and whether its processes live.

What `hybridllm status`, `logs` and `down` need, and nothing more: this module imports no
renderer, autoscaler or Kubernetes client, so those commands start at once (the
supervisor and the planner import their names from here).
"""

from __future__ import annotations

import os
from pathlib import Path

PLAN_FILE = "plan.json"
STATE_FILE = "state.json"
LOCK_FILE = "supervisor.lock"
SCRAPE_FILE = "scrape-targets.json"  # Prometheus file_sd: what to scrape, labelled
SPEC_FILE = "spec.json"  # the spec the service runs now; `hybridllm apply` replaces it
ACTION_FILE = "rollout-action"  # a hand command for the rollout (`hybridllm rollout --local`)
SUPERVISOR_LOG = "supervisor.log"
TOKEN_FILE = "backend-token"  # the runtimes' backend token (mode 0600), for `hybridllm profile`
LOG_DIR = "logs"

LOOPBACK = "127.0.0.1"
DEFAULT_GATEWAY_PORT = 8080
DEFAULT_GRACE_S = 30.0


def state_root() -> Path:
    """Where local services keep their state: ``$XDG_STATE_HOME/hybridllm/local``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "hybridllm" / "local"


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat):
    with the pid it names one process, so a pid the kernel reused is never mistaken."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int | None, start_time: int | None) -> bool:
    if not pid:
        return False
    now = proc_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_action(state_dir: Path, action: str) -> None:
    """A hand command for the service's rollout (the operator's annotation, locally)."""
    atomic_write(state_dir / ACTION_FILE, action + "\n")
