"""Helpers of the gateway benchmark: servers, CPU accounting, the gateway's histogram.

CPU is read from ``/proc/<pid>/stat`` (utime + stime) of every process in a server's
session (each server is started in its own session, so the gateway's ``--workers``
children count with it); the machine's busy time comes from ``/proc/stat`` and shows how
much CPU everything else on this shared machine took during a cell.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from loadgen import KEY

TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- servers


def wait_up(url: str, proc: subprocess.Popen[bytes], path: str, timeout_s: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status < 500:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


def start(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Starts a server in its own session; ``cpus`` pins it (and its children) to those CPUs."""
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        start_new_session=True, preexec_fn=pin,
    )  # fmt: skip


def cpu_sets(layout: str) -> dict[str, set[int] | None]:
    """CPUs per role (``proxy``: the target under test, ``backend``, ``client``: the load
    generator). ``shared``: every process may run anywhere (the scheduler decides).
    ``split``: the proxy gets the last CPU to itself, the load generator and the backend
    share the others, as a gateway pod with its own CPU request would run. ``client``: the
    load generator gets the first CPU to itself (it then measures without waiting for a
    CPU), the backend and the proxy share the others."""
    if layout == "shared":
        return {"proxy": None, "backend": None, "client": None}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--cpu-layout {layout} needs at least 2 CPUs")
    if layout == "split":
        return {"proxy": {cpus[-1]}, "backend": set(cpus[:-1]), "client": set(cpus[:-1])}
    return {"proxy": set(cpus[1:]), "backend": set(cpus[1:]), "client": {cpus[0]}}


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1),
            "python": platform.python_version(), "os": platform.platform()}  # fmt: skip


def added_buckets(url: str) -> dict[float, float]:
    """The gateway's own added-latency histogram (cumulative counts by upper bound)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("hybridllm_gateway_added_latency_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """Upper bound of the bucket holding quantile q of the observations between two scrapes."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    for le, n in counts:
        if n >= q * total:
            return le
    return None


def drain(url: str, timeout_s: float = 180.0) -> None:
    """Waits until the target answers one request, so a backlog left by a cell (requests
    the load generator gave up on) does not spill CPU into the next cell."""
    import urllib.request

    body = json.dumps({"model": "smollm2", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "authorization": "Bearer " + KEY})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
    except OSError as exc:
        print(f"drain of {url} did not finish: {exc}", flush=True)


def session_cpu_s(sid: int) -> float:
    """CPU seconds used so far by the processes of session ``sid``.

    Live processes count their own time and that of the children they reaped (a worker
    that a multi-process server such as LiteLLM's restarts would otherwise take its CPU
    out of the sum when it ends).
    """
    ticks = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # the process ended between listing and reading
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # field 6, session id
            # fields 14-17: utime, stime, cutime, cstime
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / TICK


def runq_wait_s(pids: list[int]) -> dict[int, float]:
    """Seconds each of ``pids`` (all its threads) spent runnable but waiting for a CPU."""
    out: dict[int, float] = {}
    for pid in pids:
        ns = 0
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                ns += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the thread ended between listing and reading
        out[pid] = ns / 1e9
    return out


def runq_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """Run-queue wait between two readings, over the processes alive at both."""
    return sum(after[pid] - before[pid] for pid in after if pid in before)


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(d.name))
    return pids


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent outside idle and iowait since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
