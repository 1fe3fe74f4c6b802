"""Cost per million tokens, from what an architecture used and a stated price.

Measured here on CPUs: the core-seconds every process of an architecture used over the
run (``/proc``), priced per core-hour. Projected to a cluster: the replicas each pool
needs, priced per GPU-hour (or core-hour for CPU pools), over the tokens they serve in
that hour. Prices are inputs and every results file states the ones used.
"""

from __future__ import annotations

from dataclasses import dataclass

MILLION = 1_000_000


def per_million(spend: float, tokens: float) -> float:
    """Money per million tokens; infinite when nothing was served (never divide silently)."""
    if tokens < 0 or spend < 0:
        raise ValueError(f"spend {spend} and tokens {tokens} must be non-negative")
    return float("inf") if tokens == 0 else spend / tokens * MILLION


def cpu_cost_per_million(core_seconds: float, tokens: float, price_per_core_hour: float) -> float:
    """A measured run: the cores it used (CPU seconds), priced per core-hour."""
    return per_million(core_seconds / 3600.0 * price_per_core_hour, tokens)


@dataclass(frozen=True)
class Pool:
    """A pool of a projected deployment: its replicas and what one replica costs an hour."""

    name: str
    replicas: int
    price_per_replica_hour: float  # e.g. GPUs per replica x price per GPU-hour

    def hourly(self) -> float:
        if self.replicas < 0:
            raise ValueError(f"pool {self.name}: {self.replicas} replicas")
        return self.replicas * self.price_per_replica_hour


def cluster_cost_per_million(pools: list[Pool], tokens_per_hour: float) -> float:
    """A projected deployment: every pool's hourly price over the tokens served per hour."""
    return per_million(sum(p.hourly() for p in pools), tokens_per_hour)
