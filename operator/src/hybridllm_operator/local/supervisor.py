"""The local supervisor: runs a :class:`~hybridllm_operator.local.plan.Plan` as processes.

What a kubelet, a Service and the operator do for a service, on one machine, each
concern in its own module, composed here by :class:`Supervisor`:

- **the processes** (:mod:`.processes`: :class:`~.processes.Processes`, :class:`Proc`):
  every runtime replica starts at once, the gateway once its routing table has a
  backend; readiness probes on ``/health``; restarts with back-off (the kubelet's
  CrashLoopBackOff, shorter); retiring and replacing a replica by draining it; SIGTERM
  with a grace period, then SIGKILL, to each child's own process group, and
  ``PR_SET_PDEATHSIG`` so that no child outlives a supervisor;
- **the routing** (:mod:`.routing`: :class:`~.routing.Routing`,
  :func:`served_everywhere`): the operator's routing table with one backend per ready
  replica, rewritten at each change, and the check that the gateway serves what it lists;
- **the control loops** (:mod:`.loops`): the operator's autoscaler
  (:class:`~.loops.AutoscalingLoop`, :func:`autoscaler_from_env`) starting standby slots
  and retiring replicas, and its rollout controller (:class:`~.loops.RolloutLoop`,
  :func:`write_spec`): ``hybridllm apply`` writes ``spec.json`` and wakes the supervisor
  (SIGUSR1), a new ``spec.model.revision`` runs as a canary beside the stable replicas,
  weighted in the table, analysed from the gateway's ``/metrics``, then promoted;
- **here**: the wiring, the service's phase ("starting" until the gateway serves every
  ready replica, then "ready" or "degraded") and its banner, and what other shells read:
  ``state.json`` (phase, pids, ports, restarts; rewritten atomically on every change)
  lets ``status``, ``logs`` and ``down`` work from another shell, ``scrape-targets.json``
  lists the processes for Prometheus, and ``supervisor.lock`` (an flock held for the
  supervisor's life) keeps a second supervisor of the same service from starting. A
  SIGINT/SIGTERM stops it cleanly (the gateway first, so requests in flight finish, then
  the runtimes); a second Ctrl-C skips the grace period.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from hybridllm_common import crd
from hybridllm_operator.llmservice import autoscaling, builders, rollout
from hybridllm_operator.local import plan as plan_mod
from hybridllm_operator.local.files import (
    DEFAULT_GRACE_S,
    LOCK_FILE,
    LOOPBACK,
    PLAN_FILE,
    SCRAPE_FILE,
    SPEC_FILE,
    STATE_FILE,
    atomic_write,
    proc_start_time,
)
from hybridllm_operator.local.loops import (
    AutoscalingLoop,
    RolloutLoop,
    autoscaler_from_env,
    decision_state,
    write_spec,
)
from hybridllm_operator.local.plan import Plan, local_scaled_pools
from hybridllm_operator.local.processes import Proc, Processes, describe_exit
from hybridllm_operator.local.routing import Routing, served_everywhere
from hybridllm_operator.observability import metrics as observed
from hybridllm_operator.observability import page

# what `cli`, `__main__`, the benchmarks and the tests import from here
__all__ = [
    "AlreadyRunning",
    "Proc",
    "Supervisor",
    "autoscaler_from_env",
    "describe_exit",
    "run_detached",
    "served_everywhere",
    "write_spec",
]


class AlreadyRunning(Exception):
    pass


class Supervisor:
    """One service's processes (``processes``), routing table (``routing``) and control
    loops (``autoscaling_loop``, ``rollout_loop``), with the phase and the state file."""

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
        self.tasks: list[asyncio.Task[None]] = []  # the control loops
        self._wake = asyncio.Event()  # SIGUSR1 (a new spec, a hand command), a process change
        self.phase = "starting"
        self.t0 = time.monotonic()
        self.started_wall = time.time()
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._announcing: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None
        published = asyncio.Event()  # a first routing table: the gateway may start
        self.processes = Processes(
            plan, state_dir, grace_s=grace_s, say=self.say, stop=self._stop, force=self._force,
            gateway_gate=published, on_status=self._status_changed, on_change=self._update_phase,
        )  # fmt: skip
        self.routing = Routing(
            plan, self.processes, service=self.service, say=self.say, published=published
        )
        self.autoscaling_loop = AutoscalingLoop(
            plan, self.processes, stop=self._stop, say=self.say, write_state=self.write_state
        )
        self.rollout_loop = RolloutLoop(
            plan, state_dir, self.processes, self.routing, self.autoscaling_loop,
            service=self.service, stop=self._stop, wake=self._wake, say=self.say,
            write_state=self.write_state,
        )  # fmt: skip

    # ----------------------------------------------------------------- the parts' state

    @property
    def procs(self) -> list[Proc]:
        return self.processes.procs

    @property
    def spec(self) -> crd.LLMServiceSpec:
        """The plan's spec, until `hybridllm apply` gives another."""
        return self.rollout_loop.spec

    @spec.setter
    def spec(self, spec: crd.LLMServiceSpec) -> None:
        self.rollout_loop.spec = spec

    @property
    def rollouts(self) -> rollout.Controller:
        return self.rollout_loop.controller

    @property
    def scaling(self) -> autoscaling.ServiceAutoscaler | None:
        return self.autoscaling_loop.scaling

    def service(self) -> builders.Service:
        """The service as the operator's renderer sees it now: the applied spec, the
        replicas the autoscaler runs and the rollout's state."""
        scaled = {c: len(self.processes.active(c)) for c in local_scaled_pools(self.spec)}
        return builders.Service(
            name=self.plan.name, namespace=plan_mod.NAMESPACE, uid="local", spec=self.spec,
            scaled=scaled, rollout=self.rollouts.state,
            forecast=rollout.canary_forecast(self.scaling, self.rollouts.state, self.spec),
        )  # fmt: skip

    def _update_routing(self) -> None:
        self.routing.update()

    def _status_changed(self, proc: Proc) -> None:
        """A replica's new status: the routing table (not while stopping), the phase, and
        the rollout loop woken."""
        if proc.replica.component != "gateway" and self.phase != "stopping":
            self._update_routing()
        self._update_phase()
        self._wake.set()

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
                "pools": {c: decision_state(d) for c, d in self.scaling.decisions.items()},
                "capacity": dict(self.scaling.capacity),  # each pool's, and where it comes from
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
        await self.routing.until_served(self._stop, timeout_s)
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

    # ----------------------------------------------------------------- main

    def _on_signal(self, signum: int) -> None:
        if self._stop.is_set():
            self.say("second signal: stopping now, without the grace period")
            self._force.set()
            return
        self.say(f"{signal.Signals(signum).name}: draining, then stopping")
        self._stop.set()
        self._wake.set()

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
        self.rollout_loop.publish_spec()
        self.say(
            f"starting {self.plan.name} from {self.plan.manifest}: "
            + ", ".join(p.replica.name for p in self.procs)
        )
        self.write_state()
        self.processes.start_all()
        if self.autoscaling_loop.wanted():
            self.tasks.append(asyncio.create_task(self.autoscaling_loop.run()))
        self.tasks.append(asyncio.create_task(self.rollout_loop.run()))
        await self._stop.wait()
        self.phase = "stopping"
        self.write_state()
        await self.processes.stop_all()  # the front door first, the KV source last
        await asyncio.gather(*self.processes.tasks, *self.tasks, return_exceptions=True)
        for path in (self.state_dir / STATE_FILE, self.state_dir / SCRAPE_FILE,
                     self.state_dir / SPEC_FILE, Path(self.plan.routing_path)):  # fmt: skip
            path.unlink(missing_ok=True)
        self.say(f"{self.plan.name} stopped")
        return 0


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
