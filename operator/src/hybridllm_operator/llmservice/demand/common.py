"""The demand every reader gives the autoscaler, and what the readers share.

A reader (`DemandSource`) gives a `Snapshot`: each tier's `TierDemand` now, the history in
bins, and, per tier, why a value is missing. The series names and tiers are the gateway's;
`histogram_quantile` is Prometheus's, for the readers that sum the buckets themselves
(`gateway.GatewayScrape`, and the rollout's analysis).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from hybridllm_common import metrics as names
from hybridllm_common.speed import TierSpeed

TIERS = ("edge", "cloud")
TTFT_QUANTILE = 0.95
HTTP_TIMEOUT_S = 2.0
OFFERED_PROMPT = names.GATEWAY_OFFERED_PROMPT_TOKENS_TOTAL
OFFERED_COMPLETION = names.GATEWAY_OFFERED_COMPLETION_TOKENS_TOTAL


@dataclass(frozen=True)
class TierDemand:
    prompt_tok_s: float
    completion_tok_s: float
    in_flight: float = 0.0
    ttft_p95_s: float | None = None  # None: no request finished in the window
    # requests held for want of a replica now, plus those that found none in the window
    waiting: float = 0.0
    # requests the gateways answered 503 for this tier in the window (it was overloaded)
    overloaded: float = 0.0
    # the tier's replicas' speed as the gateways learned it (capacity: auto); None: none yet
    speed: TierSpeed | None = None
    # attempts on the tier's replicas that timed out before a first byte, in the window
    timed_out: float = 0.0


@dataclass(frozen=True)
class Snapshot:
    """Demand per tier now, the history in bins, and what could not be read."""

    tiers: dict[str, TierDemand]
    bins: dict[str, list[tuple[float, float]]]  # tier -> complete bins (prompt, completion tok/s)
    bins_start_s: float  # when the first bin of every tier's list began
    problems: dict[str, str] = field(default_factory=dict)  # tier -> why it is missing


class DemandSource:
    def read(self, now_s: float) -> Snapshot:
        raise NotImplementedError


StrandedMinute = tuple[int, float, float]  # (start s, prompt tokens, completion tokens)


def add_stranded(
    snapshot: Snapshot, bin_s: float, minutes: Iterable[StrandedMinute], width_s: float = 60.0
) -> Snapshot:
    """``snapshot`` with the demand a fleet's sites stranded (``EdgeFleet.status.
    strandedDemand``: minutes of tokens refused at a site because the cloud tier was
    unreachable from it) added to the cloud tier's history, each minute's tokens spread
    over the bins it overlaps. Minutes outside the history change nothing; without a cloud
    history there is nothing to add them to."""
    bins = snapshot.bins.get("cloud")
    if not bins:
        return snapshot
    out = [[p, c] for p, c in bins]
    t0 = snapshot.bins_start_s
    for start, prompt, completion in minutes:
        end = start + width_s
        first = max(0, int((start - t0) // bin_s))
        for i in range(first, min(len(out), math.ceil((end - t0) / bin_s))):
            lo, hi = t0 + i * bin_s, t0 + (i + 1) * bin_s
            share = (min(hi, end) - max(lo, start)) / width_s
            if share > 0:
                out[i][0] += prompt * share / bin_s
                out[i][1] += completion * share / bin_s
    return replace(snapshot, bins={**snapshot.bins, "cloud": [(p, c) for p, c in out]})


class WithStranded(DemandSource):
    """A reader whose cloud history also holds what the sites stranded (`add_stranded`)."""

    def __init__(
        self, inner: DemandSource, bin_s: float, minutes: Callable[[], Iterable[StrandedMinute]]
    ) -> None:
        self.inner, self.bin_s, self.minutes = inner, bin_s, minutes

    def read(self, now_s: float) -> Snapshot:
        return add_stranded(self.inner.read(now_s), self.bin_s, self.minutes())


# --------------------------------------------------------------------------- histogram


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count}), interpolated
    linearly inside the bucket as Prometheus's ``histogram_quantile`` does."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # in the +Inf bucket: the largest finite bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound
