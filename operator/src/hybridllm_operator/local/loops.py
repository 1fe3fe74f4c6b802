"""The local supervisor's control loops: the operator's own policies, run on processes.

- **autoscaling** (:class:`AutoscalingLoop`; edge and monolithic pools, when
  ``spec.autoscaling.mode`` scales): the operator's autoscaler
  (`hybridllm_operator.llmservice.autoscaling`) reads the gateway's ``/metrics`` every interval and
  the loop starts standby slots or retires replicas: a retired replica leaves the routing
  table first, then gets SIGTERM and finishes what it is answering;
- **rollouts** (:class:`RolloutLoop`): the operator's rollout controller
  (`hybridllm_operator.llmservice.rollout`). ``hybridllm apply`` writes a new spec (``spec.json``,
  :func:`write_spec`) and wakes the supervisor (SIGUSR1); a new ``spec.model.revision``
  starts the canary's replicas (``edge-canary-0``) beside the stable ones, the routing
  table weights the two revisions as the operator's does, each step is analysed from the
  gateway's ``/metrics``, and at promotion the stable replicas are restarted one at a time
  on the new revision (out of the table, drained, started again) before the canary is
  retired. ``hybridllm rollout ... --local`` writes a hand command to ``rollout-action``.

Both act through :class:`~.processes.Processes` (start, retire, replace) and the rollout
loop rewrites the table through :class:`~.routing.Routing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridllm_common import crd
from hybridllm_forecaster.autoscaler import DECIDING, Decision
from hybridllm_operator.llmservice import (
    analysis,
    autoscaling,
    builders,
    demand,
    rollout,
)
from hybridllm_operator.local import plan as plan_mod
from hybridllm_operator.local.files import ACTION_FILE, SPEC_FILE, atomic_write
from hybridllm_operator.local.plan import Plan, local_scaled_pools
from hybridllm_operator.local.processes import Proc, Processes, last_line
from hybridllm_operator.local.routing import Routing
from hybridllm_operator.settings import OperatorSettings


def autoscaler_from_env() -> autoscaling.ServiceAutoscaler:
    """An autoscaler with the operator's forecast settings (``HYBRIDLLM_OPERATOR_FORECAST_*``
    in the environment), as the operator makes one in a cluster."""
    settings = OperatorSettings()
    return autoscaling.ServiceAutoscaler(
        bin_s=settings.forecast_bin_seconds, model=settings.forecast_model,
        season_s=settings.forecast_season_seconds,
    )  # fmt: skip


def decision_state(d: Decision) -> dict[str, Any]:
    """One pool's last decision in the state file: the replicas, each policy's part and
    the forecast over the lead time (replicas at target), as the operator's status has."""
    out = {"desired": d.desired, "reason": d.reason, "reactive": d.reactive,
           "predictive": d.predictive}  # fmt: skip
    for key, value in (("predictedP50", d.predicted_p50), ("predictedP90", d.predicted_p90)):
        if value is not None:
            out[key] = round(value, 3)
    return out


def write_spec(state_dir: Path, spec: crd.LLMServiceSpec) -> None:
    """The spec a service runs, for `hybridllm apply` to compare with and replace."""
    atomic_write(state_dir / SPEC_FILE, json.dumps(spec.to_wire(), indent=2) + "\n")


class AutoscalingLoop:
    """The operator's autoscaler sizing the plan's scaled pools (``scaling`` once it runs)."""

    def __init__(
        self,
        plan: Plan,
        processes: Processes,
        *,
        stop: asyncio.Event,
        say: Callable[[str], None],
        write_state: Callable[[], None],
    ) -> None:
        self.plan = plan
        self.processes = processes
        self._stop = stop
        self.say = say
        self.write_state = write_state
        self.scaling: autoscaling.ServiceAutoscaler | None = None

    def wanted(self) -> bool:
        """Whether the plan has pools the autoscaler sizes, in a mode that decides."""
        spec = self.plan.service().spec
        return bool(local_scaled_pools(spec)) and spec.autoscaling.mode.value in DECIDING

    async def run(self) -> None:
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
        gateway = [p for p in self.processes.procs if p.replica.component == "gateway"]
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
                threads.get(p.replica.component, 1) for p in self.processes.procs
                if p.replica.component != "gateway" and p.status != "standby"
            )  # fmt: skip
            observed = {
                c: autoscaling.Observed(
                    replicas=len(self.processes.active(c)),
                    ready=sum(p.status == "ready" for p in self.processes.active(c)),
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
                self.resize(component, new)
            self.write_state()

    def resize(self, component: str, replicas: int) -> None:
        """A pool to ``replicas``: standby slots started, or the highest indexes retired."""
        active = self.processes.active(component)
        if replicas > len(active):
            standby = [
                p for p in self.processes.procs
                if p.replica.component == component and p.replica.track is None
                and p.status == "standby"
            ]  # fmt: skip
            for proc in standby[: replicas - len(active)]:
                self.processes.run_slot(proc)
        for proc in sorted(active, key=lambda p: p.replica.index)[replicas:]:
            self.processes.retire(proc)


class RolloutLoop:
    """The operator's rollout controller (``controller``) on the applied spec (``spec``:
    the plan's, until `hybridllm apply` gives another) and the processes it converges."""

    def __init__(
        self,
        plan: Plan,
        state_dir: Path,
        processes: Processes,
        routing: Routing,
        autoscaling_loop: AutoscalingLoop,
        *,
        service: Callable[[], builders.Service],
        stop: asyncio.Event,
        wake: asyncio.Event,
        say: Callable[[str], None],
        write_state: Callable[[], None],
    ) -> None:
        self.plan = plan
        self.state_dir = state_dir
        self.processes = processes
        self.routing = routing
        self.autoscaling_loop = autoscaling_loop
        self.service = service
        self._stop = stop
        self._wake = wake  # SIGUSR1 (a new spec, a hand command), a process change
        self.say = say
        self.write_state = write_state
        self.spec = plan.service().spec
        self.controller = rollout.Controller()
        self._spec_stamp: tuple[int, int] | None = None

    # ----------------------------------------------------------------- spec and commands

    def publish_spec(self) -> None:
        """At the start: the spec this run starts from in ``spec.json`` (for `apply`),
        and no hand command left from a last run."""
        (self.state_dir / ACTION_FILE).unlink(missing_ok=True)
        write_spec(self.state_dir, self.spec)
        self._spec_stamp = None

    def _reload_spec(self) -> None:
        """The spec ``hybridllm apply`` left in ``spec.json``, once per change."""
        path = self.state_dir / SPEC_FILE
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._spec_stamp:
                return
            self._spec_stamp = stamp
            spec = crd.parse_spec(self.plan.name, json.loads(path.read_text()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, crd.InvalidSpec) as exc:
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

    # ----------------------------------------------------------------- converging

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
            kv = self.processes.kv_ports(None)
            for proc in self.processes.pool(pool.component, None):
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
        procs = self.processes.procs
        if not any(p.updating for p in procs):
            due = [p for p in procs if p.pending is not None and p.pid is not None]
            if due:
                self.processes.replace(due[0])
        self._converge_canary([p for p in pools if p.track == builders.CANARY])
        self.routing.update()
        self.controller.readiness = self._readiness(service, pools)

    def _converge_canary(self, pools: list[builders.Pool]) -> None:
        """The canary's replicas: started on fresh ports up to each pool's size, retired
        past it, when their spec is not the canary's any more, or with the canary."""
        wanted = {p.component for p in pools}
        for component in ("edge", "monolithic", "prefill", "decode"):
            if component not in wanted:
                for proc in self.processes.pool(component, builders.CANARY):
                    if not proc.retiring:
                        self.processes.retire(proc)
        for pool in pools:  # prefill before decode: a decode replica needs their KV ports
            kv = self.processes.kv_ports(builders.CANARY)
            procs = self.processes.pool(pool.component, builders.CANARY)
            live = [p for p in procs if not p.retiring]
            matching = []
            for proc in live:
                r = proc.replica
                if plan_mod.place(pool, r.index, r.port, kv_port=r.kv_port, prefill_kv=kv) == r:
                    matching.append(proc)
                else:
                    self.processes.retire(proc)
            size = self._canary_size(pool)
            index = max((p.replica.index for p in procs), default=-1) + 1
            for _ in range(size - len(matching)):
                ports = plan_mod.free_ports(2 if pool.component == "prefill" else 1)
                kv_port = ports[1] if pool.component == "prefill" else None
                self.processes.start(
                    plan_mod.place(pool, index, ports[0], kv_port=kv_port, prefill_kv=kv)
                )
                index += 1
            for proc in sorted(matching, key=lambda p: p.replica.index)[size:]:
                self.processes.retire(proc)

    def _canary_size(self, pool: builders.Pool) -> int:
        """How many replicas a canary pool runs: the renderer's, but prefill and decode
        keep the size they started with (a decode replica knows its prefill replicas)."""
        if pool.component in ("prefill", "decode"):
            procs = self.processes.pool(pool.component, builders.CANARY)
            live = [p for p in procs if not p.retiring]
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
            procs = self.processes.pool(pool.component, builders.CANARY)
            have = sum(p.status == "ready" and not p.retiring for p in procs)
            if have < (want := self._canary_size(pool)):
                short.append(f"{pool.component} {have}/{want} ready")
        canary_ready = service.canary is not None and not short
        stable_ready = all(
            p.status == "ready" and p.pending is None and not p.updating
            for p in self.processes.procs
            if p.replica.track is None and p.replica.component != "gateway"
            and p.status != "standby" and not p.retiring
        )  # fmt: skip
        problem = None
        for p in self.processes.procs:
            if p.replica.track and not p.retiring and p.restarts and p.ready_after_s is None:
                problem = f"{p.replica.name} exited ({p.last_exit}): {last_line(p.log)}"
                break
        return rollout.Readiness(canary_ready, stable_ready, problem, ", ".join(short) or None)

    # ----------------------------------------------------------------- the loop

    async def run(self) -> None:
        """The operator's rollout loop for this service: read a new spec and a hand
        command, converge the processes, look at the gateway's metrics, advance the
        controller, and again when the state or a process changed."""
        metrics = f"{self.plan.gateway_url}/metrics"
        gateway: list[Proc] = [p for p in self.processes.procs if p.replica.component == "gateway"]
        source = analysis.ScrapeWindows(
            lambda: [metrics] if any(p.status == "ready" for p in gateway) else []
        )
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self._wake.clear()
            self._reload_spec()
            action = self._read_action()
            scaling = self.autoscaling_loop.scaling
            profile = (
                scaling.day_profile()
                if scaling is not None and rollout.is_scheduled(self.controller.state)
                else None
            )
            obs = await loop.run_in_executor(
                None,
                rollout.look,
                self.controller,
                self.spec,
                source,
                action,
                None,
                None,
                profile,
                scaling.forecast_need if scaling is not None else None,
            )
            before = self.controller.state
            self.controller.advance(self.spec, obs)
            for kind, reason, message in self.controller.take_events():
                self.say(
                    f"rollout: {reason}: {message}" + (" (warning)" if kind == "Warning" else "")
                )
            if action is not None:
                self._clear_action(action)
            self._converge()  # after the controller saw the new spec, as a reconcile does
            if self.controller.state != before:
                self.write_state()
                continue
            wait = rollout.tick_seconds(self.controller.state, self.spec)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)
