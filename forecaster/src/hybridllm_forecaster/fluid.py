"""Fluid simulator: one step per control interval, queueing from closed-form approximations.

A 14-day ServeGen trace is about 236 million requests; simulating each one in Python
would take hours, and scaling the rate down far enough to make it cheap changes the
queueing (a pool of 2 replicas is not a pool of 60 at 1/30 of the load). So the long
traces are simulated as a fluid, step by step (15 s, the HPA's sync period):

- Work (`capacity.PoolConfig.work_per_s`: replicas' worth, 1 where a replica
  saturates) arrives at the step's rate and is served by the ready replicas at 1 per
  replica per second; what is not served waits as backlog, first in first out.
- TTFT of a step's requests = time to drain the backlog ahead of them + queueing for a
  replica's prefill slot + the prefill. A prompt holds the slot for its tokens at the
  prefill rate plus one decode step per 512-token chunk (decode runs between chunks),
  so the slot is busier than the prefill share of the work. The queueing is Kingman's
  G/G/1 per replica with the aggregate arrival CV thinned over the ready replicas
  (QNA's splitting rule, ``1 + (ca^2 - 1) / ready^0.75``), log-normal prompt lengths,
  and an exponential tail. Its two free constants (``KINGMAN_K``, ``THIN_POWER``) were
  fitted to the per-request simulator (`des.py`) on 29 (window, utilisation) points
  of ServeGen m-large's test half: 5 windows with inter-arrival CV 1.3 to 15, each at
  utilisations 0.5 to 0.9, at full rate (40 to 200 replicas). Mean absolute error
  3.5 points of attainment; within 3 points up to utilisation 0.85, pessimistic past
  the cliff at 0.9 (where every policy fails anyway). A test holds it to the DES on
  a window it was not fitted on.
- TBT: by Little's law a replica decoding ``lam * out`` tokens/s runs a batch ``b`` with
  ``b = lam * out * tbt`` and ``tbt = step(b) + rho_slot * chunk_time``; the share of
  requests within the SLO is a normal spread around that mean (fitted on the same
  points).
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
from hybridllm_forecaster.rollouts import CanaryRollout, InPlaceRollout
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
    prompt_sigma: float = 1.0,
    overlay: CanaryRollout | InPlaceRollout | None = None,
) -> SimResult:
    """`prompt_sigma`: log-normal spread of prompt lengths (1.0, the ServeGen sampler's;
    `evaluate` passes the measured one when the trace has requests). `overlay`: a
    rollout beside the pool (its canary's replicas serve and are paid for; it caps the
    pool to the room it leaves)."""
    dt = pool.control_interval_s
    s = step_series(demand, dt)
    rate, tin, tout, cv = s["req_per_s"], s["input_tok_per_s"], s["output_tok_per_s"], s["cv"]
    num_steps = len(rate)
    cap = pool.capacity
    max_batch = pool.max_batch
    do_prefill = pool.role != "decode"
    do_decode = pool.role != "prefill"
    work = pool.work_per_s(tin, tout, rate)
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
            backlog, rate[km1], float(work[km1]), tout[km1], typical_step_s
        )
        obs = Observation(now, ready, ready + len(starting), last_work, in_flight)
        desired = policy.decide(obs)
        if overlay is not None:
            desired = overlay.cap(now, desired)
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
        serving, paid = ready, provisioned
        if overlay is not None:
            serving, paid = overlay.step_at(now, ready, provisioned, dt)
        if paid != changes[-1][1]:
            changes.append((now, paid))

        # the step's demand against the ready replicas
        n = rate[k] * dt
        step_work = work[k] * dt
        capacity = serving * dt
        total = backlog + step_work
        new_backlog = max(0.0, total - capacity)
        delay = 0.5 * (backlog + new_backlog) / serving if serving > 0 else math.inf
        backlog = new_backlog
        p_ttft, p_tbt = _step_attainment(
            delay, cv[k], rate[k], tin[k], tout[k], serving, pool, max_batch, do_prefill,
            do_decode, prompt_sigma,
        )  # fmt: skip
        out_prov[k], out_ready[k], out_att[k] = paid, serving, p_ttft * p_tbt
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
    backlog: float, rate: float, work: float, tout: float, step_s: float
) -> float:
    """Requests waiting or running, for the queue-length policy (Little's law on the fluid):
    the backlog (replica-seconds) over the work of one request, plus the decoding ones."""
    if rate <= 0:
        return 0.0
    work_per_req = work / rate
    waiting = backlog / work_per_req if work_per_req > 0 else 0.0
    running = tout * step_s  # rate * mean output tokens * seconds per token
    return waiting + running


# Calibration of the queueing approximation against the per-request simulator (see the
# module docstring): Kingman's mean wait scaled by K * rho^(A-1), the aggregate arrival
# CV thinned over ready^THIN replicas, and the per-request TBT spread around the mean.
KINGMAN_K = 0.3
KINGMAN_A = 1.0
THIN_POWER = 0.75
TBT_BIAS = 0.08  # of the TBT SLO: the fluid's mean step is that much above the DES's
TBT_SPREAD = 0.05  # of the TBT SLO: standard deviation of per-request mean TBT
_Z = np.array([-2.0, -1.5, -1.15, -0.85, -0.6, -0.35, -0.12, 0.12, 0.35, 0.6, 0.85, 1.15,
               1.5, 2.0])  # fmt: skip


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _step_attainment(
    delay: float, cv: float, rate: float, tin: float, tout: float, ready: int,
    pool: PoolConfig, max_batch: int, do_prefill: bool, do_decode: bool, sigma: float = 1.0,
) -> tuple[float, float]:  # fmt: skip
    """Share of a step's requests within the TTFT SLO, and within the TBT SLO.

    Per replica: requests arrive at ``lam = rate / ready``; a prompt holds the prefill
    slot for ``s = tokens / prefill_tok_s + chunks * step(b)`` (decode steps run between
    its chunks), so the slot is busy ``rho = lam * s``; the decode batch ``b`` follows from
    Little's law, ``b = lam * out * tbt`` with ``tbt = step(b) + rho * chunk_time``
    (linear in ``b``, solved in closed form). TTFT = backlog delay + queueing for the
    slot (Kingman, calibrated) + the prefill, whose length is log-normal.
    """
    if rate <= 0:
        return 1.0, 1.0
    if ready <= 0 or not math.isfinite(delay):
        return 0.0, 0.0
    cap, slo = pool.capacity, pool.slo
    lam = rate / ready
    mean_in = tin / rate if do_prefill else 0.0
    mean_out = tout / rate if do_decode else 0.0
    s0 = mean_in / cap.prefill_tok_s
    chunks = (mean_in / cap.prefill_chunk_tokens + 0.5) if do_prefill else 0.0
    chunk_t = cap.prefill_chunk_tokens / cap.prefill_tok_s if do_prefill else 0.0
    c0 = cap.tbt_base_s + lam * (s0 + chunks * cap.tbt_base_s) * chunk_t
    c1 = cap.tbt_per_seq_s * (1.0 + lam * chunks * chunk_t)
    little = lam * max(mean_out - 1.0, 0.0)
    b = little * c0 / (1.0 - little * c1) if little * c1 < 1.0 else math.inf
    b = min(b, float(max_batch))
    step = cap.step_s(b)
    s_eff = s0 + chunks * step
    rho = lam * s_eff
    p_ttft = 1.0
    x = slo.ttft_s - delay
    if x <= 0:
        p_ttft = 0.0
    elif do_prefill and s_eff > 0:
        if rho >= 1.0:
            p_ttft = 0.0
        else:
            ca2 = 1.0 + (cv * cv - 1.0) / ready**THIN_POWER
            cs2 = math.exp(sigma**2) - 1.0
            wq = KINGMAN_K * rho**KINGMAN_A / (1.0 - rho) * (ca2 + cs2) / 2.0 * s_eff
            mu = math.log(s_eff) - sigma**2 / 2.0
            within = _phi((math.log(x) - mu) / sigma) if sigma > 0 else float(s_eff <= x)
            s = np.exp(mu + sigma * _Z)
            s = s[s < x]
            waited_ok = float(np.mean(1.0 - np.exp(-(x - s) * rho / wq))) if len(s) else 0.0
            p_ttft = within * ((1.0 - rho) + rho * waited_ok) if wq > 0 else within
    if not do_decode:
        return p_ttft, 1.0
    tbt = step + min(rho, 1.0) * chunk_t
    p_tbt = _phi((slo.tbt_s * (1.0 + TBT_BIAS) - tbt) / (TBT_SPREAD * slo.tbt_s))
    return p_ttft, p_tbt
