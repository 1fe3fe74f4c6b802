"""Fluid simulator: one step per control interval, queueing from closed-form approximations.

A 14-day ServeGen trace is about 236 million requests; simulating each one in Python
would take hours, and scaling the rate down far enough to make it cheap changes the
queueing (a pool of 2 replicas is not a pool of 60 at 1/30 of the load). So the long
traces are simulated as a fluid, step by step (15 s, the HPA's sync period):

- Work (replica-seconds, `capacity.PoolConfig.work_per_s`) arrives at the step's rate
  and is served by the ready replicas at 1 replica-second per second; what is not
  served waits as backlog, first in first out.
- TTFT of a step's requests = time to drain the backlog ahead of them + queueing for a
  prefill slot + the mean prefill time. The queueing is Kingman's G/G/1 approximation
  per replica (mean wait ``rho / (1 - rho) * (ca^2 + cs^2) / 2 * s``, with the arrival
  CV that the trace gives and cs = 1) with an exponential tail, from which the share of
  requests within the SLO follows in closed form.
- TBT: by Little's law a replica decoding ``x`` tokens/s with a prefill share ``rho_p``
  runs a batch ``b`` that solves ``b = x / (1 - rho_p) * step(b)``; the step meets the
  SLO when ``step(b) / (1 - rho_p) <= tbt_slo``.
- Replicas asked for become ready after the cold start; a scale-down removes starting
  replicas first, then ready ones (draining is instant in this model).

The per-request simulator (`des.py`) checks these approximations on the request traces.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from hybridllm_forecaster.capacity import PoolConfig
from hybridllm_forecaster.policies import Observation, Policy
from hybridllm_forecaster.simresult import SimResult, integrate_changes
from hybridllm_forecaster.stream import DemandSeries


def step_series(demand: DemandSeries, step_s: float) -> dict[str, np.ndarray]:
    """The demand series resampled to `step_s` steps (piecewise constant within bins)."""
    num_steps = int(demand.duration_s // step_s)
    bins = np.minimum(
        (np.arange(num_steps) * step_s // demand.bin_s).astype(int), demand.num_bins - 1
    )
    return {
        "req_per_s": demand.req_per_s[bins],
        "input_tok_per_s": demand.input_tok_per_s[bins],
        "output_tok_per_s": demand.output_tok_per_s[bins],
        "cv": demand.cv()[bins],
    }


def simulate_fluid(
    demand: DemandSeries,
    pool: PoolConfig,
    policy: Policy,
    *,
    initial_replicas: int | None = None,
) -> SimResult:
    dt = pool.control_interval_s
    s = step_series(demand, dt)
    rate, tin, tout, cv = s["req_per_s"], s["input_tok_per_s"], s["output_tok_per_s"], s["cv"]
    num_steps = len(rate)
    cap = pool.capacity
    prefill_tok_s = cap.prefill_tok_s
    decode_tok_s = pool.decode_tok_s
    max_batch = pool.max_batch
    do_prefill = pool.role != "decode"
    do_decode = pool.role != "prefill"
    work = pool.work_per_s(tin, tout)
    typical_step_s = cap.step_s(max_batch / 2)

    start = initial_replicas or pool.replicas_for(float(work[0]) if num_steps else 0.0)
    ready = start
    starting: deque[float] = deque()  # ready-at times, oldest first
    backlog = 0.0
    last_work = float(work[0]) if num_steps else 0.0
    out_prov = np.zeros(num_steps)
    out_ready = np.zeros(num_steps)
    out_att = np.zeros(num_steps)
    changes: list[tuple[float, int]] = [(0.0, start)]
    n_total = ok_total = ok_ttft = ok_tbt = 0.0

    for k in range(num_steps):
        now = k * dt
        while starting and starting[0] <= now:
            starting.popleft()
            ready += 1
        km1 = max(k - 1, 0)  # what was measured over the last interval
        in_flight = backlog_in_flight(
            backlog, ready, rate[km1], tin[km1], tout[km1], prefill_tok_s, decode_tok_s,
            do_prefill, typical_step_s,
        )  # fmt: skip
        obs = Observation(now, ready, ready + len(starting), last_work, in_flight)
        desired = policy.decide(obs)
        provisioned = ready + len(starting)
        if desired > provisioned:
            for _ in range(desired - provisioned):
                starting.append(now + pool.cold_start_s)
        elif desired < provisioned:
            drop = provisioned - desired
            while drop and starting:
                starting.pop()
                drop -= 1
            ready -= min(drop, ready)
        provisioned = ready + len(starting)
        if provisioned != changes[-1][1]:
            changes.append((now, provisioned))

        # the step's demand against the ready replicas
        n = rate[k] * dt
        pre_work = tin[k] * dt / prefill_tok_s if do_prefill else 0.0
        step_work = work[k] * dt
        capacity = ready * dt
        total = backlog + step_work
        new_backlog = max(0.0, total - capacity)
        if ready > 0:
            delay = 0.5 * (backlog + new_backlog) / ready
            rho_p = min(0.99, pre_work / capacity)
        else:
            delay, rho_p = math.inf, 0.99
        backlog = new_backlog
        p_ttft, p_tbt = _step_attainment(
            delay, rho_p, cv[k], rate[k], tin[k], tout[k], ready, pool, prefill_tok_s, max_batch,
            do_prefill, do_decode,
        )  # fmt: skip
        out_prov[k], out_ready[k], out_att[k] = provisioned, ready, p_ttft * p_tbt
        n_total += n
        ok_total += n * p_ttft * p_tbt
        ok_ttft += n * p_ttft
        ok_tbt += n * p_tbt
        last_work = float(work[k])

    duration = num_steps * dt
    return SimResult(
        policy=policy.name,
        simulator="fluid",
        num_requests=n_total,
        slo_attainment=ok_total / n_total if n_total else 1.0,
        ttft_attainment=ok_ttft / n_total if n_total else 1.0,
        tbt_attainment=ok_tbt / n_total if n_total else 1.0,
        replica_hours=integrate_changes(changes, duration),
        duration_s=duration,
        times_s=np.arange(num_steps) * dt,
        work_per_s=work,
        provisioned=out_prov,
        ready=out_ready,
        attainment=out_att,
        replica_changes=changes,
        extra={"final_backlog_replica_s": backlog},
    )


def backlog_in_flight(
    backlog: float, ready: int, rate: float, tin: float, tout: float,
    prefill_tok_s: float, decode_tok_s: float, do_prefill: bool, step_s: float,
) -> float:  # fmt: skip
    """Requests waiting or running, for the queue-length policy (Little's law on the fluid)."""
    if rate <= 0:
        return 0.0
    work_per_req = (((tin / prefill_tok_s) if do_prefill else 0.0) + tout / decode_tok_s) / rate
    waiting = backlog / work_per_req if work_per_req > 0 else 0.0
    running = tout * step_s  # rate * mean output tokens * seconds per token
    return waiting + running


def _step_attainment(
    delay: float, rho_p: float, cv: float, rate: float, tin: float, tout: float, ready: int,
    pool: PoolConfig, prefill_tok_s: float, max_batch: int, do_prefill: bool, do_decode: bool,
) -> tuple[float, float]:  # fmt: skip
    """Share of a step's requests within the TTFT SLO, and whether its TBT meets the SLO."""
    if rate <= 0:
        return 1.0, 1.0
    if not math.isfinite(delay):
        return 0.0, 0.0
    slo = pool.slo
    s = (tin / rate) / prefill_tok_s if do_prefill else 0.0
    slack = slo.ttft_s - delay - s
    if slack <= 0:
        p_ttft = 0.0
    elif do_prefill and rho_p > 0:
        wq = rho_p / (1.0 - rho_p) * (cv * cv + 1.0) / 2.0 * s
        p_ttft = 1.0 - rho_p * math.exp(-rho_p * slack / wq) if wq > 0 else 1.0
    else:
        p_ttft = 1.0
    if not do_decode:
        return p_ttft, 1.0
    cap = pool.capacity
    x = tout / ready / (1.0 - rho_p)  # tokens/s a replica decodes while not prefilling
    denom = 1.0 - x * cap.tbt_per_seq_s
    batch = x * cap.tbt_base_s / denom if denom > 0 else math.inf
    batch = min(batch, max_batch)
    tbt = cap.step_s(batch) / (1.0 - rho_p)
    return p_ttft, 1.0 if tbt <= slo.tbt_s else 0.0
