"""The local supervisor's child processes: what a kubelet does for pods, on one machine.

- **start order by health**: every runtime replica starts at once; the gateway starts
  once the first routing table is written (``gateway_gate``: its table needs a backend),
  and a replica counts as ready while its ``/health`` answers 200 (a readiness probe:
  0.5 s while starting, 2 s once ready, three failures in a row make it unready);
- **restarts with back-off**: a replica that exits is started again after 1 s, doubling
  up to 30 s, reset once it has run for 60 s (the kubelet's CrashLoopBackOff, shorter);
  one replaced by a new spec starts again at once on it;
- **retiring and replacing**: a retired or replaced replica is drained (out of the routing
  table, then SIGTERM once the gateway has reloaded it: it finishes what it answers);
- **stopping**: SIGTERM to each process group with a grace period, SIGKILL after it (or
  at once on a second Ctrl-C). Every child runs in its own process group (so its own
  children go with it) and gets SIGTERM from the kernel if the supervisor itself dies
  (``PR_SET_PDEATHSIG``): no orphan outlives a supervisor.

:class:`Processes` owns the :class:`Proc` list; what a status change means for the rest
(the routing table, the service's phase, the rollout loop) it leaves to its callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from hybridllm_common import backend_auth
from hybridllm_operator.llmservice import builders
from hybridllm_operator.local.files import LOG_DIR, TOKEN_FILE, proc_start_time
from hybridllm_operator.local.plan import Plan, Replica

PROBE_STARTING_S = 0.5
PROBE_READY_S = 2.0
PROBE_TIMEOUT_S = 2.0
UNREADY_AFTER_FAILURES = 3
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
RETIRE_DELAY_S = 3.0  # a retired replica's wait between leaving the table and SIGTERM

_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def last_line(path: Path) -> str:
    """A process's last words: the last line of its log (what a pod's termination
    message would say), cut to 300 characters."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "no output"


def killpg(pid: int | None, signum: int) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)


@dataclasses.dataclass
class Proc:
    """One replica's process and what the supervisor knows of it."""

    replica: Replica
    log: Path
    # pending, starting, ready, unready, backoff, stopped; standby (a slot not running),
    # draining (being retired), updating (being restarted on a new spec)
    status: str = "pending"
    retiring: bool = False  # once it exits: back on standby (a canary's: gone)
    draining: bool = False  # out of the routing table, its probe ignored, until it exits
    pending: Replica | None = None  # what it runs next: a restart on the new spec is due
    updating: bool = False  # restarted on a new spec and not ready again yet
    pid: int | None = None
    start_time: int | None = None
    restarts: int = 0
    started_at: float | None = None
    ready_after_s: float | None = None
    last_exit: str | None = None
    woken: asyncio.Event = dataclasses.field(default_factory=asyncio.Event, repr=False)
    process: asyncio.subprocess.Process | None = dataclasses.field(default=None, repr=False)

    def to_state(self) -> dict[str, Any]:
        r = self.replica
        return {
            "name": r.name,
            "component": r.component,
            "index": r.index,
            "pid": self.pid,
            "start_time": self.start_time,
            "port": r.port,
            "kv_port": r.kv_port,
            "url": r.url,
            "revision": r.revision or None,
            "track": r.track,
            "status": self.status,
            "restarts": self.restarts,
            "ready_after_s": self.ready_after_s,
            "last_exit": self.last_exit,
            "log": str(self.log),
        }


class Processes:
    """Every replica's process (the plan's, standby slots included, and the canary's
    started later): started, probed, restarted with back-off, retired, replaced, stopped.

    ``on_status(proc)`` runs after a replica's status changed (the supervisor updates the
    routing table and the phase, and wakes the rollout loop); ``on_change()`` after one
    was started or is gone (the phase and the state file)."""

    def __init__(
        self,
        plan: Plan,
        state_dir: Path,
        *,
        grace_s: float,
        say: Callable[[str], None],
        stop: asyncio.Event,
        force: asyncio.Event,
        gateway_gate: asyncio.Event,
        on_status: Callable[[Proc], None],
        on_change: Callable[[], None],
    ) -> None:
        self.state_dir = state_dir
        self.grace_s = grace_s
        self.say = say
        self._stop = stop  # the supervisor stops: nothing starts again
        self._force = force  # a second signal: no grace period
        self._gateway_gate = gateway_gate  # set once a routing table is written
        self._on_status = on_status
        self._on_change = on_change
        self.procs = [
            Proc(
                r,
                state_dir / LOG_DIR / f"{r.name}.log",
                status="standby" if r.standby else "pending",
            )
            for r in plan.replicas
        ]
        self.tasks: list[asyncio.Task[None]] = []  # each `keep` and `drain`
        # the gateway shows it to the runtimes, which answer nobody else (backend_auth); kept
        # readable by this user alone, for the tools that measure a replica directly
        # (`hybridllm profile`)
        self.backend_token = backend_auth.new_token()
        token_file = state_dir / TOKEN_FILE
        token_file.unlink(missing_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.backend_token + "\n")

    # ----------------------------------------------------------------- which replicas

    def pool(self, component: str, track: str | None) -> list[Proc]:
        return [
            p for p in self.procs if p.replica.component == component and p.replica.track == track
        ]

    def active(self, component: str) -> list[Proc]:
        """The stable replicas of a pool that run (or are starting) and stay."""
        return [
            p for p in self.procs
            if p.replica.component == component and p.replica.track is None
            and p.status != "standby" and not p.retiring
        ]  # fmt: skip

    def kv_ports(self, track: str | None) -> list[int]:
        return [
            p.replica.kv_port for p in self.pool("prefill", track)
            if p.replica.kv_port is not None and not p.retiring
        ]  # fmt: skip

    # ----------------------------------------------------------------- starting

    def start_all(self) -> None:
        """Every replica of the plan but the standby slots."""
        self.tasks += [
            asyncio.create_task(self._keep(p)) for p in self.procs if p.status != "standby"
        ]

    def start(self, replica: Replica) -> None:
        """A new replica (a canary's), kept until it is retired."""
        proc = Proc(replica, self.state_dir / LOG_DIR / f"{replica.name}.log")
        self.procs.append(proc)
        self.tasks.append(asyncio.create_task(self._keep(proc)))

    def run_slot(self, proc: Proc) -> None:
        """A standby slot started."""
        proc.status = "pending"
        self.tasks.append(asyncio.create_task(self._keep(proc)))

    def set_status(self, proc: Proc, status: str) -> None:
        if proc.status == status:
            return
        proc.status = status
        self._on_status(proc)

    async def _spawn(self, proc: Proc) -> None:
        r = proc.replica
        proc.log.parent.mkdir(parents=True, exist_ok=True)
        with proc.log.open("ab") as log:
            header = f"==== {time.strftime('%Y-%m-%dT%H:%M:%S')} start #{proc.restarts + 1}: "
            log.write((header + " ".join(r.command) + "\n").encode())
            log.flush()
            env = {**os.environ, **r.env, "PYTHONUNBUFFERED": "1"}
            env.pop(backend_auth.TOKEN_FILE_ENV, None)
            env[backend_auth.TOKEN_ENV] = self.backend_token
            proc.process = await asyncio.create_subprocess_exec(
                *r.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_child_setup,
            )
        proc.pid = proc.process.pid
        proc.start_time = proc_start_time(proc.pid)
        proc.started_at = time.monotonic()
        proc.status = "starting"
        self._on_change()
        self.say(f"{r.name:<14} started, pid {proc.pid}, port {r.port} (log {proc.log})")

    # ----------------------------------------------------------------- probing

    async def _probe_once(self, session: aiohttp.ClientSession, proc: Proc) -> bool:
        try:
            path = builders.ready_path(proc.replica.component)
            async with session.get(f"{proc.replica.url}{path}") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _probe(self, proc: Proc) -> None:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        failures = 0
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if proc.draining:  # leaving: out of the routing table until it exits
                    pass
                elif await self._probe_once(session, proc):
                    failures = 0
                    if proc.status != "ready":
                        assert proc.started_at is not None
                        took = time.monotonic() - proc.started_at
                        again = "" if proc.ready_after_s is None else " again"
                        if proc.ready_after_s is None:
                            proc.ready_after_s = round(took, 2)
                        self.say(f"{proc.replica.name:<14} ready{again} after {took:.1f}s")
                        proc.updating = False
                        self.set_status(proc, "ready")
                else:
                    failures += 1
                    if proc.status == "ready" and failures >= UNREADY_AFTER_FAILURES:
                        path = builders.ready_path(proc.replica.component)
                        self.say(f"{proc.replica.name:<14} not ready: {path} failed {failures}x")
                        self.set_status(proc, "unready")
                ready = proc.status == "ready"
                await asyncio.sleep(PROBE_READY_S if ready else PROBE_STARTING_S)

    # ----------------------------------------------------------------- restarting

    async def _keep(self, proc: Proc) -> None:
        """Run one replica until the supervisor stops or retires it, restarting it with
        back-off when it exits, and at once on its new spec when it was replaced."""
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set() and not proc.retiring:
            if proc.replica.component == "gateway" and not await self._until(self._gateway_gate):
                return
            try:
                await self._spawn(proc)
                if self._stop.is_set():  # stopped while it was being started
                    killpg(proc.pid, signal.SIGTERM)
            except OSError as exc:
                self.say(f"{proc.replica.name:<14} cannot start: {exc}")
                proc.last_exit = f"cannot start: {exc}"
            else:
                assert proc.process is not None
                assert proc.started_at is not None
                probe = asyncio.create_task(self._probe(proc))
                code = await proc.process.wait()
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe
                proc.last_exit = describe_exit(code)
                ran = time.monotonic() - proc.started_at
                proc.pid, proc.draining = None, False
                if self._stop.is_set() or proc.retiring:
                    break
                if proc.pending is not None:  # replaced: its new spec starts now
                    proc.replica, proc.pending = proc.pending, None
                    backoff = BACKOFF_FIRST_S
                    continue
                if ran >= BACKOFF_RESET_AFTER_S:
                    backoff = BACKOFF_FIRST_S
                self.say(
                    f"{proc.replica.name:<14} exited ({proc.last_exit}) after {ran:.1f}s; "
                    f"restarting in {backoff:.0f}s (log {proc.log})"
                )
            proc.pid = None
            proc.restarts += 1
            self.set_status(proc, "backoff")
            waits = [
                asyncio.ensure_future(self._stop.wait()),
                asyncio.ensure_future(proc.woken.wait()),
            ]
            await asyncio.wait(waits, timeout=backoff, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            proc.woken.clear()
            backoff = min(backoff * 2, BACKOFF_MAX_S)
        if proc.retiring and not self._stop.is_set():
            proc.retiring = False
            if proc.replica.track:  # a canary replica is gone for good
                self.procs.remove(proc)
                self._on_change()
            else:
                self.set_status(proc, "standby")
            return
        self.set_status(proc, "stopped")

    async def _until(self, event: asyncio.Event) -> bool:
        """Wait for ``event`` or the stop; True when the event came first."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stop.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        return event.is_set() and not self._stop.is_set()

    # ----------------------------------------------------------------- retiring, replacing

    def retire(self, proc: Proc) -> None:
        """Out of the routing table first; once the gateway has reloaded it, SIGTERM: the
        server finishes what it is answering and exits; `_keep` then leaves the slot on
        standby (a canary replica's goes)."""
        proc.retiring = proc.draining = True
        proc.woken.set()  # one waiting out a back-off is not started again
        self.set_status(proc, "draining")
        self.tasks.append(asyncio.create_task(self._drain(proc)))

    def replace(self, proc: Proc) -> None:
        """A stable replica onto its new spec (``proc.pending``): out of the routing table,
        drained, then started again on the same port (``_keep``)."""
        assert proc.pending is not None
        proc.updating = proc.draining = True
        self.say(f"{proc.replica.name:<14} restarting on revision {proc.pending.revision}")
        self.set_status(proc, "updating")
        self.tasks.append(asyncio.create_task(self._drain(proc)))

    async def _drain(self, proc: Proc) -> None:
        """Wait for the gateway to reload a table without ``proc``, then SIGTERM it (not
        when a replacement was called off meanwhile: the spec went back)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), RETIRE_DELAY_S)
        if proc.updating and proc.pending is None and not proc.retiring:
            proc.updating = proc.draining = False  # its probe puts it back in the table
            return
        if not self._stop.is_set():
            await self.terminate([proc])

    # ----------------------------------------------------------------- stopping

    async def stop_all(self) -> None:
        """Every process: the front door first, the KV source last, then any replica that
        was starting meanwhile."""
        gateway = [p for p in self.procs if p.replica.component == "gateway"]
        prefill = [p for p in self.procs if p.replica.component == "prefill"]
        rest = [p for p in self.procs if p not in gateway and p not in prefill]
        for group in (gateway, rest, prefill):
            await self.terminate(group)
        await self.terminate(self.procs)

    async def terminate(self, procs: list[Proc]) -> None:
        live = [p for p in procs if p.process is not None and p.process.returncode is None]
        if not live:
            return
        groups = [p.pid for p in live]  # these: `_keep` may start a new one once one exits
        for p in live:
            self.say(f"{p.replica.name:<14} stopping (SIGTERM)")
            killpg(p.pid, signal.SIGTERM)
        waits = [asyncio.ensure_future(p.process.wait()) for p in live if p.process]
        force = asyncio.ensure_future(self._force.wait())
        await asyncio.wait(
            [asyncio.ensure_future(asyncio.wait(waits)), force],
            timeout=self.grace_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        force.cancel()
        for p, group in zip(live, groups, strict=True):
            if p.pid == group and p.process is not None and p.process.returncode is None:
                self.say(f"{p.replica.name:<14} did not stop in time: SIGKILL")
                killpg(group, signal.SIGKILL)
        await asyncio.gather(*waits, return_exceptions=True)
        for group in groups:  # the group too: a child that outlived its leader
            killpg(group, signal.SIGKILL)
