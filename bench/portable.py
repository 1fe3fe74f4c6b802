"""What results files record about where they ran: paths relative to the repository (the
home folder as ``~``), and the machine's CPU model and memory.

A results file is read on other machines; this machine's checkout and home directory mean
nothing there (``/home/x/hybridllm/.venv/bin/python`` becomes ``.venv/bin/python``).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The development traces (ServeGen, Azure, Mooncake, SWE-agent) live beside the repository
# on the project's own machines, not in it. One setting says where: $HYBRIDLLM_TRACES, else
# ../shared/traces. Benchmarks that replay them refuse to run without them; tests that need
# them are marked ``traces`` and skip (tests/conftest.py).
TRACES = Path(os.environ.get("HYBRIDLLM_TRACES") or ROOT.parent / "shared" / "traces")


def portable(text: str) -> str:
    return text.replace(f"{ROOT}/", "").replace(str(ROOT), ".").replace(str(Path.home()), "~")


def cpu_and_memory() -> tuple[str, int]:
    """The CPU model name and the GiB of RAM of this machine."""
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.processor(),
    )  # fmt: skip
    return cpu, int(Path("/proc/meminfo").read_text().split()[1]) // (1 << 20)


def machine_line() -> str:
    """``N cores, CPU, M GiB RAM, load average L``: the machine line of a results file."""
    cpu, mem = cpu_and_memory()
    return f"{os.cpu_count()} cores, {cpu}, {mem} GiB RAM, load average {os.getloadavg()[0]:.2f}"


def torch_machine_line() -> str:
    """``T threads / N cores, CPU, M GiB RAM, torch V``: the machine line of a torch benchmark."""
    import torch

    cpu, mem = cpu_and_memory()
    return (
        f"{torch.get_num_threads()} threads / {os.cpu_count()} cores, {cpu}, {mem} GiB RAM, "
        f"torch {torch.__version__}"
    )


def git_head() -> str:
    """The short commit the run measured."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    return out.stdout.strip()


def model_path(arg: str | None) -> Path:
    """``--model`` when given, else the model store's SmolLM2 (converted on first use)."""
    if arg:
        return Path(arg)
    import hybridllm_models

    return Path(hybridllm_models.ensure())


def free_port() -> int:
    """A loopback port no one listens on now, for a server this benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
