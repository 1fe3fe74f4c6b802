"""What one replica sustains, and the SLO it is held to.

One replica is modelled the way a continuous-batching engine with chunked prefill
behaves (vLLM v1, our engine): every step decodes one token of each of the ``b``
running sequences, taking ``tbt_base_s + tbt_per_seq_s * b``, and may also carry a
chunk of up to ``prefill_chunk_tokens`` of one waiting prompt, which adds
``chunk / prefill_tok_s``. Averaged over steps, a replica that spends a share
``rho_p`` of its time on prefill has a mean step (the time between tokens) of
``step(b) / (1 - rho_p)``; ``max_batch`` is the largest batch whose step still meets
the TBT SLO with a prefill reserve (capped by KV memory).

Load is counted in *replicas of work*: a value of 3.2 means 3.2 replicas would be at
the point where the per-request simulator (`des.py`, the same replica) saturates; every
policy and the planner divide it by a target utilisation. Tokens alone do not say
where that is. The simulated replica prefills one prompt at a time, one chunk per
decode step, so it runs out of whichever of three things binds first
(`PoolConfig.work_per_s`):

- the decode batch: ``lost + output_tok_s / decode_tok_s``, the token measure, with
  ``decode_tok_s = max_batch / step(max_batch)`` the decode throughput at full batch;
- the TBT objective: a replica stepping once per ``tbt_s`` spends ``tbt_base_s / tbt_s``
  of its time on the steps' fixed cost, so ``(lost + output_tok_s * tbt_per_seq_s) /
  (1 - tbt_base_s / tbt_s)``;
- the prefill slot: a prompt holds it for its tokens plus one decode step per chunk,
  ``tokens / prefill_tok_s + chunks * step(b)``, a short prompt a whole step; ``b`` is
  the batch the replica runs when the slot is saturated (Little's law at the TBT
  objective, at most ``max_batch``).

``lost`` is the decode time the prefills take: ``input_tok_s / prefill_tok_s``, plus,
for a prompt that ends in a partial chunk, the rest of that chunk at
``tbt_base_s / (tbt_base_s + chunk_time)`` (the replica slows every step it prefills in
by a whole chunk's time). The slot, the partial chunks and the TBT term need the
request rate; without it (``requests_per_s=None``: the operator's autoscaler, whose
demand has no request rate yet, and capacities typed as measured rates, whose decode
figure already holds the step's cost) the measure is the token measure alone,
``input_tok_s / prefill_tok_s + output_tok_s / decode_tok_s``, which reads short-prompt
loads low (20-token prompts with 20-token answers saturate the
replica at 0.33 of the token measure, 1.0 of the full one). With it the default
replica saturates (attainment under 90%, 4 or 8 replicas, Poisson arrivals) at
0.83-1.02 of this measure for prompts of 20-3,000 tokens and answers of 5-1,000, where
the token measure ranged 0.16-1.00. Prompts that take a large share of the TTFT
objective by themselves are lost to waiting behind one another, not to throughput: at
10k prefill tokens/s against 2 s, 6k-token prompts saturate at 0.72-0.93 and 10k-token
ones at 0.3-0.8, and no load measure moves that (with a 10-20 s objective they saturate
at 0.88-1.05). Prefill-only and decode-only pools (disaggregation) count only their own
half: a prefill pool's prompts run without decode steps between chunks, a decode pool's
requests arrive prefilled.

The defaults describe an 8B model on one H100 at bf16 (prefill around 10k tokens/s,
25 ms decode steps at small batch); they are parameters now and will be calibrated from
our engines' benchmarks later (`CapacityModel.from_benchmark`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from hybridllm_forecaster.stream import DemandSeries

PoolRole = Literal["monolithic", "prefill", "decode", "edge"]


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0  # time to first token, per request
    tbt_s: float = 0.1  # mean time between tokens, per request


@dataclass(frozen=True)
class CapacityModel:
    prefill_tok_s: float = 10_000.0
    tbt_base_s: float = 0.025
    tbt_per_seq_s: float = 0.0004
    kv_max_batch: int = 128  # sequences that fit in KV memory
    prefill_chunk_tokens: int = 512

    def step_s(self, batch: float) -> float:
        return self.tbt_base_s + self.tbt_per_seq_s * batch

    def prompt_chunks(self, input_tokens: np.ndarray) -> np.ndarray:
        """Chunks each prompt is prefilled in (one decode step each)."""
        return np.ceil(np.asarray(input_tokens, dtype=float) / self.prefill_chunk_tokens)

    def max_batch(self, slo: Slo, prefill_reserve: float = 0.0) -> int:
        """Largest batch meeting the TBT SLO when `prefill_reserve` of the time goes to prefills."""
        budget = slo.tbt_s * (1.0 - prefill_reserve) - self.tbt_base_s
        by_slo = math.floor(budget / self.tbt_per_seq_s) if self.tbt_per_seq_s > 0 else 10**6
        return max(1, min(self.kv_max_batch, by_slo))

    def decode_tok_s(self, slo: Slo, prefill_reserve: float = 0.0) -> float:
        b = self.max_batch(slo, prefill_reserve)
        return b / self.step_s(b)

    def scaled(self, factor: float) -> CapacityModel:
        """A replica `factor` times as large (throughput scales; per-token latency does not)."""
        return replace(
            self,
            prefill_tok_s=self.prefill_tok_s * factor,
            tbt_per_seq_s=self.tbt_per_seq_s / factor,
            kv_max_batch=max(1, round(self.kv_max_batch * factor)),
        )

    @classmethod
    def from_rates(
        cls, prefill_tok_s: float, decode_tok_s: float, max_batch: int = 32
    ) -> CapacityModel:
        """A replica given by what it sustains at the SLO (as measured): a decode step that
        does not grow with the batch, so that ``decode_tok_s`` holds at any SLO."""
        return cls(prefill_tok_s, max_batch / decode_tok_s, 0.0, max_batch)

    @classmethod
    def from_speed(
        cls, prefill_tok_s: float, step_base_s: float, step_per_seq_s: float, max_batch: int
    ) -> CapacityModel:
        """A replica as the gateway measured it (``hybridllm_common.speed``): its prefill
        rate and its decode step ``base + per_seq x batch``; ``max_batch`` the runtime's
        slots (``maxNumSeqs``, the edge's ``parallel``)."""
        return cls(prefill_tok_s, step_base_s, step_per_seq_s, max(1, max_batch))

    @classmethod
    def from_benchmark(
        cls, prefill_tok_s: float, step_s_at: dict[int, float], kv_max_batch: int
    ) -> CapacityModel:
        """Fit the decode step model to measured (batch -> step seconds) points."""
        batches = np.array(sorted(step_s_at), dtype=float)
        steps = np.array([step_s_at[int(b)] for b in batches])
        if len(batches) < 2:
            raise ValueError("need step times at two or more batch sizes")
        slope, intercept = np.polyfit(batches, steps, 1)
        return cls(prefill_tok_s, float(max(intercept, 1e-4)), float(max(slope, 0.0)), kv_max_batch)


@dataclass(frozen=True)
class PoolConfig:
    """One pool of replicas and how the planner may size it."""

    name: str = "monolithic"
    role: PoolRole = "monolithic"
    capacity: CapacityModel = field(default_factory=CapacityModel)
    slo: Slo = field(default_factory=Slo)
    cold_start_s: float = 180.0  # pod scheduled -> model loaded -> ready
    control_interval_s: float = 15.0
    min_replicas: int = 1
    max_replicas: int = 1000
    # of a replica's work capacity, for planned load: the per-request simulator's SLO
    # cliff for the default replica on ServeGen's requests is at about 0.85-0.9 (0.75-0.8
    # of the token measure work was before; see docs/forecaster.md); the ServeGen
    # training half chose 0.7, in the token measure, for the predictive policy
    # (`forecast eval` prints the choice for any trace)
    target_utilisation: float = 0.7
    scale_down_stabilisation_s: float = 300.0  # the HPA's (reactive) window
    # the planner's window: 0, because its forecast already covers the whole lead time
    forecast_down_window_s: float = 0.0

    @property
    def prefill_reserve(self) -> float:
        """Share of a replica's time kept for prefills when it also decodes."""
        return 0.0 if self.role == "decode" else 0.3

    @property
    def max_batch(self) -> int:
        return self.capacity.max_batch(self.slo, self.prefill_reserve)

    @property
    def decode_tok_s(self) -> float:
        return self.capacity.decode_tok_s(self.slo, self.prefill_reserve)

    @property
    def lead_time_s(self) -> float:
        """How far ahead a decision must look: a replica asked for now serves after this."""
        return self.cold_start_s + self.control_interval_s

    def with_(self, **changes: object) -> PoolConfig:
        return replace(self, **changes)  # type: ignore[arg-type]

    def work_per_s(
        self,
        input_tok_s: np.ndarray | float,
        output_tok_s: np.ndarray | float,
        requests_per_s: np.ndarray | float | None = None,
        *,
        chunks_per_s: np.ndarray | float | None = None,
    ) -> np.ndarray:
        """Replicas of work that this demand needs (see the module doc): the largest of
        the decode-batch, TBT and prefill-slot terms.

        `requests_per_s` adds what a request costs beyond its tokens (the prefill slot,
        partial chunks, the TBT term); without it the token measure alone counts.
        `chunks_per_s` is the
        prompts' chunks (``prompt_chunks`` summed) when the caller counted them; else
        they are estimated from the mean prompt (``mean / chunk + 0.5``, at least one),
        which is right on average for a spread of lengths."""
        cap = self.capacity
        inp = np.asarray(input_tok_s, dtype=float)
        out = np.asarray(output_tok_s, dtype=float)
        prefill = inp / cap.prefill_tok_s
        if self.role == "prefill":  # no decode steps between a prefill pool's chunks
            return prefill
        decode = out / self.decode_tok_s
        if self.role == "decode":  # prompts arrive prefilled; the batch is the bound
            return decode
        if requests_per_s is None:  # the token measure (what the operator reads today)
            return prefill + decode
        req = np.asarray(requests_per_s, dtype=float)
        some = req > 0
        per = np.where(some, req, 1.0)
        mean_in, mean_out = inp / per, out / per
        chunk = float(cap.prefill_chunk_tokens)
        if chunks_per_s is None:
            chunks = np.where(mean_in > 0, np.maximum(1.0, mean_in / chunk + 0.5), 0.0)
        else:
            chunks = np.asarray(chunks_per_s, dtype=float) / per
        # a partial chunk slows the steps it rides by a whole chunk's time
        chunk_s = chunk / cap.prefill_tok_s
        unused_s = np.maximum(chunks * chunk - mean_in, 0.0) / cap.prefill_tok_s
        lost = prefill + np.where(  # the decode time the prefills take from the replica
            some, req * unused_s * cap.tbt_base_s / (cap.tbt_base_s + chunk_s), 0.0
        )
        # the prefill slot: the prompt's tokens and one step per chunk, at the batch
        # b = (output - 1) * tbt / slot that a saturated slot leaves decoding (the root
        # of slot = a + chunks * per_seq * b), at most max_batch
        a = mean_in / cap.prefill_tok_s + chunks * cap.tbt_base_s
        q = chunks * cap.tbt_per_seq_s * np.maximum(mean_out - 1.0, 0.0) * self.slo.tbt_s
        held = (a + np.sqrt(a * a + 4.0 * q)) / 2.0
        held = np.minimum(held, mean_in / cap.prefill_tok_s + chunks * cap.step_s(self.max_batch))
        slot = np.where(some, req * held, 0.0)
        work = np.maximum(lost + decode, slot)
        free = 1.0 - cap.tbt_base_s / self.slo.tbt_s  # share of a step-per-TBT replica
        if free > 0:  # (else no step meets the objective: `attainable` counts them)
            work = np.maximum(work, (lost + out * cap.tbt_per_seq_s) / free)
        return work

    def binned_work(
        self,
        arrival_s: np.ndarray,
        input_tokens: np.ndarray,
        output_tokens: np.ndarray,
        step_s: float,
        duration_s: float,
    ) -> np.ndarray:
        """Work per second of each ``step_s`` bin of requests arriving at ``arrival_s``
        (their request rate and prompt chunks counted): the true work per control step."""
        num = max(1, math.ceil(duration_s / step_s))
        idx = np.minimum((np.asarray(arrival_s) // step_s).astype(int), num - 1)

        def per_s(weights: np.ndarray | None) -> np.ndarray:
            return np.bincount(idx, weights=weights, minlength=num) / step_s

        return self.work_per_s(
            per_s(np.asarray(input_tokens, dtype=float)),
            per_s(np.asarray(output_tokens, dtype=float)),
            per_s(None),
            chunks_per_s=per_s(self.capacity.prompt_chunks(input_tokens)),
        )

    def work_series(self, demand: DemandSeries) -> np.ndarray:
        return self.work_per_s(demand.input_tok_per_s, demand.output_tok_per_s, demand.req_per_s)

    def attainable(self, input_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
        """Which requests can meet the SLO at all: alone on an idle replica, the prompt's
        prefill within the TTFT objective and a one-sequence decode step within the TBT
        objective. No policy can serve the others in time, so attainment leaves them out
        and the report counts them."""
        cap = self.capacity
        inp = np.asarray(input_tokens, dtype=float)
        ok = np.ones(inp.shape, dtype=bool)
        if self.role != "decode":
            ok &= inp / cap.prefill_tok_s <= self.slo.ttft_s + 1e-9
        if self.role != "prefill":
            single = np.asarray(output_tokens) <= 1
            ok &= single | (cap.step_s(1) <= self.slo.tbt_s + 1e-9)
        return ok

    def replicas_for(self, work_per_s: float, utilisation: float | None = None) -> int:
        """Replicas that carry `work_per_s` at the target utilisation, within the bounds."""
        target = utilisation if utilisation is not None else self.target_utilisation
        want = math.ceil(max(work_per_s, 0.0) / target - 1e-9)
        return int(min(self.max_replicas, max(self.min_replicas, want)))


DEFAULT_POOLS: dict[str, PoolConfig] = {
    "monolithic": PoolConfig(),
    "prefill": PoolConfig(name="prefill", role="prefill"),
    "decode": PoolConfig(name="decode", role="decode"),
    # a small quantized model on a CPU/edge GPU node: slower, but it starts in seconds
    "edge": PoolConfig(
        name="edge",
        role="edge",
        capacity=CapacityModel(
            prefill_tok_s=800.0, tbt_base_s=0.03, tbt_per_seq_s=0.004, kv_max_batch=16
        ),
        cold_start_s=30.0,
    ),
}
