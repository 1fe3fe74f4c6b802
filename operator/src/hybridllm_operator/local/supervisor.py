"""The local supervisor: runs a :class:`~hybridllm_operator.local.plan.Plan` as processes.

What a kubelet and a Service do for pods, on one machine:

- **start order by health**: every runtime replica starts at once; the gateway starts
  once some tier has a ready replica (its routing table needs a backend), and the
  routing table lists only replicas whose ``/health`` answers 200 (a readiness probe:
  0.5 s while starting, 2 s once ready, three failures in a row take a replica out);
- **restarts with back-off**: a replica that exits is started again after 1 s, doubling
  up to 30 s, reset once it has run for 60 s (the kubelet's CrashLoopBackOff, shorter);
  meanwhile the gateway routes around it (it is out of the routing table, and the
  gateway's own retries and passive ejection cover the moments before the reload);
- **clean shutdown** on SIGINT/SIGTERM: the gateway first (it stops accepting and lets
  requests in flight finish), then the runtimes, each sent SIGTERM with a grace period
  and SIGKILL after it; a second Ctrl-C skips the grace. Every child runs in its own
  process group (so its own children go with it) and gets SIGTERM from the kernel if the
  supervisor itself dies (``PR_SET_PDEATHSIG``): no orphan outlives a supervisor;
- **autoscaling** (edge and monolithic pools, when ``spec.autoscaling.mode`` scales): the
  operator's own autoscaler (`hybridllm_operator.autoscaling`) reads the gateway's
  ``/metrics`` every interval and the supervisor starts standby slots or retires replicas:
  a retired replica leaves the routing table first, then gets SIGTERM and finishes what
  it is answering;
- **rollouts**: the operator's rollout controller (`hybridllm_operator.rollout`) runs in
  the supervisor. ``hybridllm apply`` writes a new spec (``spec.json``) and wakes it
  (SIGUSR1); a new ``spec.model.revision`` starts the canary's replicas (``edge-canary-0``)
  beside the stable ones, the routing table weights the two revisions as the operator's
  does, each step is analysed from the gateway's ``/metrics``, and at promotion the stable
  replicas are restarted one at a time on the new revision (out of the table, drained,
  started again) before the canary is retired. ``hybridllm rollout ... --local`` writes a
  hand command to ``rollout-action``;
- **state on disk**: ``state.json`` (phase, pids, ports, restarts; rewritten atomically
  on every change) lets ``status``, ``logs`` and ``down`` work from another shell, and
  ``supervisor.lock`` (an flock held for the supervisor's life) keeps a second
  supervisor of the same service from starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from hybridllm_common import backend_auth, crd
from hybridllm_common import metrics as names
from hybridllm_forecaster.autoscaler import DECIDING, Decision
from hybridllm_operator import analysis, autoscaling, builders, demand, reconcile, rollout
from hybridllm_operator.local import plan as plan_mod
from hybridllm_operator.local.files import (
    ACTION_FILE,
    DEFAULT_GRACE_S,
    LOCK_FILE,
    LOG_DIR,
    LOOPBACK,
    PLAN_FILE,
    SCRAPE_FILE,
    SPEC_FILE,
    STATE_FILE,
    atomic_write,
    proc_start_time,
)
from hybridllm_operator.local.plan import Plan, Replica, local_scaled_pools
from hybridllm_operator.observability import metrics as observed
from hybridllm_operator.observability import page
from hybridllm_operator.settings import OperatorSettings

PROBE_STARTING_S = 0.5
PROBE_READY_S = 2.0
PROBE_TIMEOUT_S = 2.0
UNREADY_AFTER_FAILURES = 3
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
RETIRE_DELAY_S = 3.0  # a retired replica's wait between leaving the table and SIGTERM

_PR_SET_PDEATHSIG = 1


def served_everywhere(metrics_text: str, routed: dict[str, int]) -> bool:
    """Whether a gateway's metrics show, per tier, at least the backends a routing table
    lists (``hybridllm_gateway_revision_healthy_backends``, summed over revisions)."""
    from prometheus_client.parser import text_string_to_metric_families

    healthy: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == names.GATEWAY_REVISION_HEALTHY_BACKENDS:
                tier = sample.labels.get("tier", "")
                healthy[tier] = healthy.get(tier, 0.0) + sample.value
    return all(healthy.get(tier, 0.0) >= count for tier, count in routed.items())


class AlreadyRunning(Exception):
    pass


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


class Supervisor:
    def __init__(
        self,
        plan: Plan,
        state_dir: Path,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        out: TextIO | None = None,
        metrics_address: str | None = None,
        prometheus_url: str | None = None,
    ) -> None:
        self.plan = plan
        self.state_dir = state_dir
        self.grace_s = grace_s
        self.metrics_address = metrics_address
        self.prometheus_url = prometheus_url
        self.out = out or sys.stdout
        self.procs = [
            Proc(
                r,
                state_dir / LOG_DIR / f"{r.name}.log",
                status="standby" if r.standby else "pending",
            )
            for r in plan.replicas
        ]
        self.tasks: list[asyncio.Task[None]] = []
        self.scaling: autoscaling.ServiceAutoscaler | None = None
        self.spec = plan.service().spec  # the plan's, until `hybridllm apply` gives another
        # the gateway shows it to the runtimes, which answer nobody else (backend_auth)
        self.backend_token = backend_auth.new_token()
        self.rollouts = rollout.Controller()
        self._spec_stamp: tuple[int, int] | None = None
        self._wake = asyncio.Event()  # SIGUSR1 (a new spec, a hand command), a process change
        self.phase = "starting"
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._routing_ready = asyncio.Event()
        self._routing: dict[str, Any] | None = None
        self._routed: dict[str, int] = {}  # backends per tier in the table last written
        self._announcing: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None

    # ----------------------------------------------------------------- output and state

    def say(self, text: str) -> None:
        self.out.write(f"[{time.monotonic() - self.t0:7.1f}s] {text}\n")
        self.out.flush()

    def write_state(self) -> None:
        state = {
            "name": self.plan.name,
            "manifest": self.plan.manifest,
            "phase": self.phase,
            "gateway_url": self.plan.gateway_url,
            "supervisor_pid": os.getpid(),
            "supervisor_start_time": proc_start_time(os.getpid()),
            "started_at": self.started_wall,
            "processes": [p.to_state() for p in self.procs],
        }
        if self.scaling is not None:
            state["autoscaling"] = {
                "mode": self.scaling.mode,
                "pools": {c: _decision_state(d) for c, d in self.scaling.decisions.items()},
            }
        if self.rollouts.state is not None:
            state["revision"] = self.spec.model.revision
            state["rollout"] = self.rollouts.state.to_wire()
        atomic_write(self.state_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
        atomic_write(self.state_dir / SCRAPE_FILE, json.dumps(self.scrape_targets(), indent=2))

    def scrape_targets(self) -> list[dict[str, Any]]:
        """The running processes, labelled as the chart's PodMonitor labels pods
        (namespace, llmservice, component), and the control-plane metrics (their series
        carry their own labels): a Prometheus file_sd file, rewritten at each change."""
        service = self.plan.service()
        out: list[dict[str, Any]] = [
            {
                "targets": [f"{LOOPBACK}:{p.replica.port}"],
                "labels": {
                    "namespace": service.namespace,
                    "llmservice": service.name,
                    "component": p.replica.component,
                },
            }
            for p in self.procs
            if p.pid is not None and p.status in ("starting", "ready", "unready")
        ]
        if self.metrics_address:
            host, port = observed.split_address(self.metrics_address)
            host = LOOPBACK if host in ("0.0.0.0", "::") else host
            out.append({"targets": [f"{host}:{port}"], "labels": {}})
        return out

    def _update_phase(self) -> None:
        if self.phase == "stopping":
            return
        all_ready = all(
            p.status == "ready" for p in self.procs if p.status != "standby" and not p.replica.track
        )
        if all_ready and self.phase == "starting":
            # "ready" once the gateway serves every ready replica: it reloads the table
            # naming the last of them within its reload interval, and until then a table
            # of one tier sends every request there
            if self._announcing is None or self._announcing.done():
                self._announcing = asyncio.ensure_future(self._ready_when_routed())
        elif self.phase != "starting":
            self.phase = "ready" if all_ready else "degraded"
        self.write_state()

    async def _ready_when_routed(self, timeout_s: float = 10.0) -> None:
        """Phase "ready" (and the banner) once the gateway's metrics show as many healthy
        backends per tier as the routing table lists, or after ``timeout_s`` (a gateway
        that ejected a backend meanwhile must not hold the service in "starting")."""
        deadline = time.monotonic() + timeout_s
        url = f"{self.plan.gateway_url}/metrics"
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline and not self._stop.is_set():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                    async with http.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if served_everywhere(await r.text(), self._routed):
                            break
                await asyncio.sleep(0.1)
        if self.phase == "starting" and all(
            p.status == "ready" for p in self.procs if p.status != "standby" and not p.replica.track
        ):
            self.phase = "ready"
            self._banner()
            self.write_state()

    def _banner(self) -> None:
        url = self.plan.gateway_url
        model = self.plan.service().served_name
        names = ", ".join(p.replica.name for p in self.procs if p.status != "standby")
        self.say(f"{self.plan.name} is ready at {url}/v1 ({names})")
        self.out.write(
            f"""
  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  print(client.chat.completions.create(model="{model}",
        messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)

  hybridllm status {self.plan.name}  |  hybridllm logs {self.plan.name} gateway-0  |  hybridllm down {self.plan.name}

"""
        )
        self.out.flush()

    # ----------------------------------------------------------------- routing

    def service(self) -> builders.Service:
        """The service as the operator's renderer sees it now: the applied spec, the
        replicas the autoscaler runs and the rollout's state."""
        scaled = {c: len(self._active(c)) for c in local_scaled_pools(self.spec)}
        return builders.Service(
            name=self.plan.name, namespace=plan_mod.NAMESPACE, uid="local", spec=self.spec,
            scaled=scaled, rollout=self.rollouts.state,
            forecast=rollout.canary_forecast(self.scaling, self.rollouts.state, self.spec),
        )  # fmt: skip

    def _ready_urls(self, component: str, track: str | None) -> list[str]:
        return [
            p.replica.url
            for p in self.procs
            if p.replica.component == component and p.replica.track == track
            and p.status == "ready"
        ]  # fmt: skip

    def _update_routing(self) -> None:
        """The operator's routing table (:func:`builders.routing_config`) with one backend
        per ready replica, the canary's at the rollout's weight."""
        service = self.service()
        stable = {
            tier: self._ready_urls(component, None)
            for tier, component in builders.tier_components(service).items()
        }
        canary = {}
        if service.canary is not None:
            canary = {
                tier: self._ready_urls(component, builders.CANARY)
                for tier, component in builders.tier_components(service, service.canary).items()
            }
        table = builders.routing_config(service, stable, canary)
        if table == self._routing or not (any(stable.values()) or any(canary.values())):
            # No tier has a ready replica: keep the last table (the gateway's retries and
            # ejection handle dead backends) rather than one the gateway would refuse.
            return
        self._routing = table
        self._routed = {
            t: len(stable.get(t, [])) + len(canary.get(t, [])) for t in {*stable, *canary}
        }
        atomic_write(
            Path(self.plan.routing_path), json.dumps(table, indent=2, sort_keys=True) + "\n"
        )
        if self._routing_ready.is_set():
            shown = {t: len(u) for t, u in stable.items()}
            shown |= {f"{t} (canary)": len(u) for t, u in canary.items()}
            self.say(f"routing table updated: ready replicas per tier {shown}")
        self._routing_ready.set()

    def _set_status(self, proc: Proc, status: str) -> None:
        if proc.status == status:
            return
        proc.status = status
        if proc.replica.component != "gateway" and self.phase != "stopping":
            self._update_routing()
        self._update_phase()
        self._wake.set()

    # ----------------------------------------------------------------- one replica

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
        self._update_phase()
        self.say(f"{r.name:<14} started, pid {proc.pid}, port {r.port} (log {proc.log})")

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
                        self._set_status(proc, "ready")
                else:
                    failures += 1
                    if proc.status == "ready" and failures >= UNREADY_AFTER_FAILURES:
                        path = builders.ready_path(proc.replica.component)
                        self.say(f"{proc.replica.name:<14} not ready: {path} failed {failures}x")
                        self._set_status(proc, "unready")
                ready = proc.status == "ready"
                await asyncio.sleep(PROBE_READY_S if ready else PROBE_STARTING_S)

    async def _keep(self, proc: Proc) -> None:
        """Run one replica until the supervisor stops or retires it, restarting it with
        back-off when it exits, and at once on its new spec when it was replaced."""
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set() and not proc.retiring:
            if proc.replica.component == "gateway" and not await self._until(self._routing_ready):
                return
            try:
                await self._spawn(proc)
                if self._stop.is_set():  # stopped while it was being started
                    _killpg(proc.pid, signal.SIGTERM)
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
            self._set_status(proc, "backoff")
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
                self._update_phase()
            else:
                self._set_status(proc, "standby")
            return
        self._set_status(proc, "stopped")

    async def _until(self, event: asyncio.Event) -> bool:
        """Wait for ``event`` or the stop; True when the event came first."""
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self._stop.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        return event.is_set() and not self._stop.is_set()

    # ----------------------------------------------------------------- autoscaling

    async def _autoscale(self) -> None:
        """Every interval: the gateway's demand, the autoscaler's decision, then start
        standby slots or retire replicas of each pool it sizes."""
        spec = self.plan.service().spec
        local = local_scaled_pools(spec)
        pools = crd.scaled_pools(spec)  # every pool's resources: the machine's cores held
        for pool in local.values():  # nothing here wakes a stopped pool: keep one
            pool.min_replicas = max(pool.min_replicas, 1)
        scaling = autoscaler_from_env()
        scaling.configure(spec)
        self.scaling = scaling
        metrics = f"{self.plan.gateway_url}/metrics"
        gateway = [p for p in self.procs if p.replica.component == "gateway"]
        source = demand.GatewayScrape(
            lambda: [metrics] if any(p.status == "ready" for p in gateway) else [],
            bin_s=scaling.bin_s,
        )
        loop = asyncio.get_running_loop()
        interval = float(spec.autoscaling.interval_seconds)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)
            if self._stop.is_set():
                return
            threads = {c: builders.cpu_threads(p.resources) for c, p in pools.items()}
            held = sum(
                threads.get(p.replica.component, 1) for p in self.procs
                if p.replica.component != "gateway" and p.status != "standby"
            )  # fmt: skip
            observed = {
                c: autoscaling.Observed(
                    replicas=len(self._active(c)),
                    ready=sum(p.status == "ready" for p in self._active(c)),
                    bound=plan_mod.core_bound(c, threads[c], held, os.cpu_count() or 1),
                )
                for c in local
            }
            now = time.time()
            snapshot = await loop.run_in_executor(None, source.read, now)
            changed = scaling.step(now, snapshot, observed)
            for component, (old, new) in changed.items():
                reason = scaling.decisions[component].reason
                self.say(f"autoscaler: {component} {old} -> {new} replicas ({reason})")
                self._resize(component, new)
            self.write_state()

    def _active(self, component: str) -> list[Proc]:
        """The stable replicas of a pool that run (or are starting) and stay."""
        return [
            p for p in self.procs
            if p.replica.component == component and p.replica.track is None
            and p.status != "standby" and not p.retiring
        ]  # fmt: skip

    def _resize(self, component: str, replicas: int) -> None:
        active = self._active(component)
        if replicas > len(active):
            standby = [
                p for p in self.procs
                if p.replica.component == component and p.replica.track is None
                and p.status == "standby"
            ]  # fmt: skip
            for proc in standby[: replicas - len(active)]:
                proc.status = "pending"
                self.tasks.append(asyncio.create_task(self._keep(proc)))
        for proc in sorted(active, key=lambda p: p.replica.index)[replicas:]:
            self._retire(proc)

    def _retire(self, proc: Proc) -> None:
        """Out of the routing table first; once the gateway has reloaded it, SIGTERM: the
        server finishes what it is answering and exits; `_keep` then leaves the slot on
        standby (a canary replica's goes)."""
        proc.retiring = proc.draining = True
        proc.woken.set()  # one waiting out a back-off is not started again
        self._set_status(proc, "draining")
        self.tasks.append(asyncio.create_task(self._drain(proc)))

    def _replace(self, proc: Proc) -> None:
        """A stable replica onto its new spec (``proc.pending``): out of the routing table,
        drained, then started again on the same port (``_keep``)."""
        assert proc.pending is not None
        proc.updating = proc.draining = True
        self.say(f"{proc.replica.name:<14} restarting on revision {proc.pending.revision}")
        self._set_status(proc, "updating")
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
            await self._terminate([proc])

    # ----------------------------------------------------------------- rollouts

    def _reload_spec(self) -> None:
        """The spec ``hybridllm apply`` left in ``spec.json``, once per change."""
        path = self.state_dir / SPEC_FILE
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._spec_stamp:
                return
            self._spec_stamp = stamp
            spec = reconcile.parse_spec(self.plan.name, json.loads(path.read_text()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, reconcile.InvalidSpec) as exc:
            self.say(f"{SPEC_FILE}: not applied: {exc}")
            return
        changes = plan_mod.spec_changes(self.spec, spec)
        refused = plan_mod.refused_changes(changes)
        if refused:  # `apply` refuses these; a file edited by hand may still hold them
            self.say(f"{SPEC_FILE}: not applied: {', '.join(refused)} cannot change while running")
            return
        if changes:
            self.say(f"applied: {', '.join(changes)}")
            self.spec = spec

    def _read_action(self) -> str | None:
        try:
            return (self.state_dir / ACTION_FILE).read_text().strip() or None
        except OSError:
            return None

    def _clear_action(self, action: str) -> None:
        if self._read_action() == action:  # not one written since
            (self.state_dir / ACTION_FILE).unlink(missing_ok=True)

    def _pool_procs(self, component: str, track: str | None) -> list[Proc]:
        return [
            p for p in self.procs if p.replica.component == component and p.replica.track == track
        ]

    def _kv_ports(self, track: str | None) -> list[int]:
        return [
            p.replica.kv_port for p in self._pool_procs("prefill", track)
            if p.replica.kv_port is not None and not p.retiring
        ]  # fmt: skip

    def _start(self, replica: Replica) -> None:
        proc = Proc(replica, self.state_dir / LOG_DIR / f"{replica.name}.log")
        self.procs.append(proc)
        self.tasks.append(asyncio.create_task(self._keep(proc)))

    def _converge(self) -> None:
        """Make the processes what the renderer says now (the operator's reconcile, for
        processes): stable replicas on the stable spec (restarted one at a time), the
        canary's pools at their size, the routing table, and the readiness the rollout
        controller reads."""
        if self._stop.is_set():
            return
        service = self.service()
        pools = [p for p in builders.pools(service) if p.component != "gateway"]
        for pool in (p for p in pools if p.track is None):
            kv = self._kv_ports(None)
            for proc in self._pool_procs(pool.component, None):
                r = proc.replica
                want = plan_mod.place(
                    pool, r.index, r.port, kv_port=r.kv_port, prefill_kv=kv, standby=r.standby
                )
                if want == r:
                    proc.pending = None
                elif proc.pid is None:  # not running: its next start runs the new spec
                    proc.replica, proc.pending = want, None
                else:
                    proc.pending = want
        if not any(p.updating for p in self.procs):
            due = [p for p in self.procs if p.pending is not None and p.pid is not None]
            if due:
                self._replace(due[0])
        self._converge_canary([p for p in pools if p.track == builders.CANARY])
        self._update_routing()
        self.rollouts.readiness = self._readiness(service, pools)

    def _converge_canary(self, pools: list[builders.Pool]) -> None:
        """The canary's replicas: started on fresh ports up to each pool's size, retired
        past it, when their spec is not the canary's any more, or with the canary."""
        wanted = {p.component for p in pools}
        for component in ("edge", "monolithic", "prefill", "decode"):
            if component not in wanted:
                for proc in self._pool_procs(component, builders.CANARY):
                    if not proc.retiring:
                        self._retire(proc)
        for pool in pools:  # prefill before decode: a decode replica needs their KV ports
            kv = self._kv_ports(builders.CANARY)
            procs = self._pool_procs(pool.component, builders.CANARY)
            live = [p for p in procs if not p.retiring]
            matching = []
            for proc in live:
                r = proc.replica
                if plan_mod.place(pool, r.index, r.port, kv_port=r.kv_port, prefill_kv=kv) == r:
                    matching.append(proc)
                else:
                    self._retire(proc)
            size = self._canary_size(pool)
            index = max((p.replica.index for p in procs), default=-1) + 1
            for _ in range(size - len(matching)):
                ports = plan_mod.free_ports(2 if pool.component == "prefill" else 1)
                kv_port = ports[1] if pool.component == "prefill" else None
                self._start(plan_mod.place(pool, index, ports[0], kv_port=kv_port, prefill_kv=kv))
                index += 1
            for proc in sorted(matching, key=lambda p: p.replica.index)[size:]:
                self._retire(proc)

    def _canary_size(self, pool: builders.Pool) -> int:
        """How many replicas a canary pool runs: the renderer's, but prefill and decode
        keep the size they started with (a decode replica knows its prefill replicas)."""
        if pool.component in ("prefill", "decode"):
            live = [p for p in self._pool_procs(pool.component, builders.CANARY) if not p.retiring]
            if live:
                return len(live)
        return pool.replicas or 1

    def _readiness(
        self, service: builders.Service, pools: list[builders.Pool]
    ) -> rollout.Readiness:
        """The pools as the rollout controller reads them: the canary's all up at their
        size, the stable ones all on the stable spec and ready, or why the canary's
        replicas cannot run (one that exited before it was ever ready)."""
        short = []
        for pool in pools:
            if pool.track != builders.CANARY:
                continue
            procs = self._pool_procs(pool.component, builders.CANARY)
            have = sum(p.status == "ready" and not p.retiring for p in procs)
            if have < (want := self._canary_size(pool)):
                short.append(f"{pool.component} {have}/{want} ready")
        canary_ready = service.canary is not None and not short
        stable_ready = all(
            p.status == "ready" and p.pending is None and not p.updating
            for p in self.procs
            if p.replica.track is None and p.replica.component != "gateway"
            and p.status != "standby" and not p.retiring
        )  # fmt: skip
        problem = None
        for p in self.procs:
            if p.replica.track and not p.retiring and p.restarts and p.ready_after_s is None:
                problem = f"{p.replica.name} exited ({p.last_exit}): {_last_line(p.log)}"
                break
        return rollout.Readiness(canary_ready, stable_ready, problem, ", ".join(short) or None)

    async def _rollout(self) -> None:
        """The operator's rollout loop for this service: read a new spec and a hand
        command, converge the processes, look at the gateway's metrics, advance the
        controller, and again when the state or a process changed."""
        metrics = f"{self.plan.gateway_url}/metrics"
        gateway = [p for p in self.procs if p.replica.component == "gateway"]
        source = analysis.ScrapeWindows(
            lambda: [metrics] if any(p.status == "ready" for p in gateway) else []
        )
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self._wake.clear()
            self._reload_spec()
            action = self._read_action()
            profile = (
                self.scaling.day_profile()
                if self.scaling is not None and rollout.is_scheduled(self.rollouts.state)
                else None
            )
            obs = await loop.run_in_executor(
                None,
                rollout.look,
                self.rollouts,
                self.spec,
                source,
                action,
                None,
                None,
                profile,
                self.scaling.forecast_need if self.scaling is not None else None,
            )
            before = self.rollouts.state
            self.rollouts.advance(self.spec, obs)
            for kind, reason, message in self.rollouts.take_events():
                self.say(
                    f"rollout: {reason}: {message}" + (" (warning)" if kind == "Warning" else "")
                )
            if action is not None:
                self._clear_action(action)
            self._converge()  # after the controller saw the new spec, as a reconcile does
            if self.rollouts.state != before:
                self.write_state()
                continue
            wait = rollout.tick_seconds(self.rollouts.state, self.spec)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    # ----------------------------------------------------------------- stopping

    async def _terminate(self, procs: list[Proc]) -> None:
        live = [p for p in procs if p.process is not None and p.process.returncode is None]
        if not live:
            return
        groups = [p.pid for p in live]  # these: `_keep` may start a new one once one exits
        for p in live:
            self.say(f"{p.replica.name:<14} stopping (SIGTERM)")
            _killpg(p.pid, signal.SIGTERM)
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
                _killpg(group, signal.SIGKILL)
        await asyncio.gather(*waits, return_exceptions=True)
        for group in groups:  # the group too: a child that outlived its leader
            _killpg(group, signal.SIGKILL)

    def _on_signal(self, signum: int) -> None:
        if self._stop.is_set():
            self.say("second signal: stopping now, without the grace period")
            self._force.set()
            return
        self.say(f"{signal.Signals(signum).name}: draining, then stopping")
        self._stop.set()
        self._wake.set()

    # ----------------------------------------------------------------- main

    def _acquire_lock(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(
                f"{self.plan.name} is already running (see `hybridllm status {self.plan.name}`)"
            ) from None
        self._lock_fd = fd

    def views(self) -> list[observed.ServiceView]:
        """This service as the control-plane metrics show it (the operator's collector)."""
        service = self.plan.service()
        return [
            observed.ServiceView(
                service.namespace, service.name, self.spec, self.scaling, self.rollouts.state
            )
        ]

    async def run(self) -> int:
        self._acquire_lock()
        stop_metrics = None
        if self.metrics_address:
            exported = observed.OperatorMetrics(self.views)
            exported.lead(True)  # one supervisor per service: it always decides
            stop_metrics = page.serve(exported, self.metrics_address, self.prometheus_url)
            self.say(
                f"dashboard on http://{self.metrics_address}/, control-plane metrics on "
                f"/metrics; Prometheus may scrape {self.state_dir / SCRAPE_FILE}"
            )
        try:
            return await self._run()
        finally:
            if stop_metrics is not None:
                stop_metrics()

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGUSR1, self._wake.set)  # `apply`, `rollout --local`
        (self.state_dir / ACTION_FILE).unlink(missing_ok=True)  # a command for the last run
        write_spec(self.state_dir, self.spec)
        self._spec_stamp = None
        self.say(
            f"starting {self.plan.name} from {self.plan.manifest}: "
            + ", ".join(p.replica.name for p in self.procs)
        )
        self.write_state()
        self.tasks = [
            asyncio.create_task(self._keep(p)) for p in self.procs if p.status != "standby"
        ]
        spec = self.plan.service().spec
        if local_scaled_pools(spec) and spec.autoscaling.mode.value in DECIDING:
            self.tasks.append(asyncio.create_task(self._autoscale()))
        self.tasks.append(asyncio.create_task(self._rollout()))
        await self._stop.wait()
        self.phase = "stopping"
        self.write_state()
        gateway = [p for p in self.procs if p.replica.component == "gateway"]
        prefill = [p for p in self.procs if p.replica.component == "prefill"]
        rest = [p for p in self.procs if p not in gateway and p not in prefill]
        for group in (gateway, rest, prefill):  # the front door first, the KV source last
            await self._terminate(group)
        await self._terminate(self.procs)  # any replica that was starting meanwhile
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for path in (self.state_dir / STATE_FILE, self.state_dir / SCRAPE_FILE,
                     self.state_dir / SPEC_FILE, Path(self.plan.routing_path)):  # fmt: skip
            path.unlink(missing_ok=True)
        self.say(f"{self.plan.name} stopped")
        return 0


def _decision_state(d: Decision) -> dict[str, Any]:
    """One pool's last decision in the state file: the replicas, each policy's part and
    the forecast over the lead time (replicas at target), as the operator's status has."""
    out = {"desired": d.desired, "reason": d.reason, "reactive": d.reactive,
           "predictive": d.predictive}  # fmt: skip
    for key, value in (("predictedP50", d.predicted_p50), ("predictedP90", d.predicted_p90)):
        if value is not None:
            out[key] = round(value, 3)
    return out


def autoscaler_from_env() -> autoscaling.ServiceAutoscaler:
    """An autoscaler with the operator's forecast settings (``HYBRIDLLM_OPERATOR_FORECAST_*``
    in the environment), as the operator makes one in a cluster."""
    settings = OperatorSettings()
    return autoscaling.ServiceAutoscaler(
        bin_s=settings.forecast_bin_seconds, model=settings.forecast_model,
        season_s=settings.forecast_season_seconds,
    )  # fmt: skip


def write_spec(state_dir: Path, spec: crd.LLMServiceSpec) -> None:
    """The spec a service runs, for `hybridllm apply` to compare with and replace."""
    atomic_write(state_dir / SPEC_FILE, json.dumps(spec.to_wire(), indent=2) + "\n")


def _last_line(path: Path) -> str:
    """A process's last words: the last line of its log (what a pod's termination
    message would say), cut to 300 characters."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][-300:] if lines else "no output"


def _killpg(pid: int | None, signum: int) -> None:
    if pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)


def run_detached(
    state_dir: Path,
    grace_s: float,
    metrics_address: str | None = None,
    prometheus_url: str | None = None,
) -> int:
    """The body of ``python -m hybridllm_operator.local STATE_DIR``: a supervisor for the
    plan ``up`` wrote there, its output going to ``supervisor.log``."""
    plan = Plan.from_json((state_dir / PLAN_FILE).read_text())
    supervisor = Supervisor(
        plan, state_dir, grace_s=grace_s, metrics_address=metrics_address,
        prometheus_url=prometheus_url,
    )  # fmt: skip
    try:
        return asyncio.run(supervisor.run())
    except AlreadyRunning as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
