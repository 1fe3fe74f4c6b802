"""What a simulation run reports: SLO attainment, replica-hours and time series for plots.

Both simulators fill the same `SimResult`. ``replica_hours`` always equals the integral
of the ``replicas`` step function recorded in ``replica_changes`` (a test holds the
simulators to that), and the per-interval series are what the plots draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SimResult:
    policy: str
    simulator: str  # "des" or "fluid"
    num_requests: float
    slo_attainment: float  # share of requests meeting both TTFT and TBT SLOs
    ttft_attainment: float
    tbt_attainment: float
    replica_hours: float
    duration_s: float
    # per control interval
    times_s: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    work_per_s: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    provisioned: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    ready: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    attainment: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    # exact step function of replicas paid for: (time, count from then on)
    replica_changes: list[tuple[float, int]] = field(repr=False, default_factory=list)
    num_completed: int = 0
    ttft_p99_s: float = float("nan")
    # requests no policy can serve within the SLO (`PoolConfig.attainable`): left out of
    # the attainment figures (the per-request simulator; the fluid cannot tell them apart)
    num_unattainable: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def mean_replicas(self) -> float:
        return self.replica_hours * 3600.0 / self.duration_s if self.duration_s > 0 else 0.0

    def summary(self) -> dict[str, float | str]:
        return {
            "policy": self.policy,
            "simulator": self.simulator,
            "slo_attainment": self.slo_attainment,
            "ttft_attainment": self.ttft_attainment,
            "tbt_attainment": self.tbt_attainment,
            "replica_hours": self.replica_hours,
            "mean_replicas": self.mean_replicas,
            "ttft_p99_s": self.ttft_p99_s,
            "num_requests": self.num_requests,
        }


def integrate_changes(changes: list[tuple[float, int]], end_s: float) -> float:
    """Replica-hours of a (time, count) step function up to `end_s`."""
    if not changes:
        return 0.0
    times = np.array([t for t, _ in changes] + [end_s])
    counts = np.array([c for _, c in changes], dtype=float)
    return float(np.sum(counts * np.diff(times)) / 3600.0)
