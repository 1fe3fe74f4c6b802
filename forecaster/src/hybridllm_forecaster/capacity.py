"""What one replica sustains, and the SLO it is held to.

One replica is modelled the way a continuous-batching engine with chunked prefill
behaves (vLLM v1, our engine): every step decodes one token of each of the ``b``
running sequences, taking ``tbt_base_s + tbt_per_seq_s * b``, and may also carry a
chunk of up to ``prefill_chunk_tokens`` of one waiting prompt, which adds
``chunk / prefill_tok_s``. Averaged over steps, a replica that spends a share
``rho_p`` of its time on prefill has a mean step (the time between tokens) of
``step(b) / (1 - rho_p)``; ``max_batch`` is the largest batch whose step still meets
the TBT SLO with a prefill reserve (capped by KV memory).

Load is counted in *replica-seconds of work per second*: ``input_tok_s / prefill_tok_s +
output_tok_s / decode_tok_s`` where ``decode_tok_s = max_batch / step(max_batch)`` is
the decode throughput at full batch. A value of 3.2 means that 3.2 replicas would be
100% busy; every policy and the planner divide it by a target utilisation. Prefill-only
and decode-only pools (disaggregation) count only their own half.

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
    # cliff for the default replica is at about 0.75-0.8 (see docs/forecaster.md); the
    # ServeGen training half chose 0.7 for the predictive policy (`forecast eval` prints
    # the choice for any trace)
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
        self, input_tok_s: np.ndarray | float, output_tok_s: np.ndarray | float
    ) -> np.ndarray:
        """Replica-seconds of work per second that these token rates need (see module doc)."""
        pre = np.asarray(input_tok_s, dtype=float) / self.capacity.prefill_tok_s
        dec = np.asarray(output_tok_s, dtype=float) / self.decode_tok_s
        if self.role == "prefill":
            return pre
        if self.role == "decode":
            return dec
        return pre + dec

    def work_series(self, demand: DemandSeries) -> np.ndarray:
        return self.work_per_s(demand.input_tok_per_s, demand.output_tok_per_s)

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
