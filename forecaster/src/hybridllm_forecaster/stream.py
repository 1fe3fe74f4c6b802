"""The two shapes every trace is turned into: a request stream and a demand series.

A `RequestStream` is one row per request (arrival time, input and output tokens, and
session / prefix ids when the trace has them), held as parallel numpy arrays so a
million requests cost a few tens of megabytes and binning is one `np.bincount`.

A `DemandSeries` is what the forecaster and the planner see: fixed-width bins of
request rate and token rates. Request traces are binned into one; ServeGen-style rate
traces become one directly (their per-window rates are exact, so nothing is sampled),
which is what makes a 14-day, 236-million-request trace cheap to forecast and simulate.
`DemandSeries.arrival_cv` carries the inter-arrival coefficient of variation per bin
when the trace knows it (ServeGen does; binned request streams measure it), because the
queueing approximation of the fluid simulator needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class RequestStream:
    """Requests sorted by arrival; all arrays have one entry per request."""

    arrival_s: np.ndarray  # [num_requests] float64, seconds from the trace start
    input_tokens: np.ndarray  # [num_requests] int64
    output_tokens: np.ndarray  # [num_requests] int64
    session_ids: np.ndarray | None = None  # [num_requests] int64, -1 when unknown
    prefix_ids: list[list[int]] | None = None  # per request, block hash ids (Mooncake)
    source: str = ""
    start_epoch_s: float | None = None  # wall-clock time of arrival_s == 0 when known
    notes: list[str] = field(default_factory=list)
    # The file's own clock at arrival_s == 0 (its first timestamp, in seconds): how the files
    # of one trace split by time are put back in order (loaders._concat).
    origin_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("input_tokens", "output_tokens"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected {n}")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrival_s must be sorted")

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if self.num_requests else 0.0

    def scaled(self, factor: float, seed: int = 0, jitter_s: float = 60.0) -> RequestStream:
        """The same traffic from a population ``factor`` times as large: each request kept
        with probability ``factor`` (below 1), or ``ceil(factor)`` copies of the trace,
        each arrival moved by up to ``jitter_s``, thinned to ``factor`` (above 1). Request
        sizes and the shape of the rate over time are the trace's; sessions and prefix
        blocks are dropped (copies would share them)."""
        if factor <= 0:
            raise ValueError(f"a demand scale must be positive, got {factor:g}")
        rng = np.random.default_rng(seed)
        copies = max(1, math.ceil(factor))
        arrival = np.concatenate([
            self.arrival_s + (rng.uniform(0.0, jitter_s, self.num_requests) if k else 0.0)
            for k in range(copies)
        ])  # fmt: skip
        keep = rng.random(len(arrival)) < factor / copies
        order = np.argsort(arrival[keep], kind="stable")
        return RequestStream(
            arrival_s=arrival[keep][order],
            input_tokens=np.tile(self.input_tokens, copies)[keep][order],
            output_tokens=np.tile(self.output_tokens, copies)[keep][order],
            source=self.source,
            start_epoch_s=self.start_epoch_s,
            notes=[*self.notes, f"demand scaled x{factor:.3g} ({int(np.sum(keep)):,} of "
                                f"{self.num_requests:,} requests' population)"],
        )  # fmt: skip

    def to_demand(self, bin_s: float) -> DemandSeries:
        """Bin the stream into a demand series of `bin_s`-second bins."""
        if self.num_requests == 0:
            raise ValueError(f"{self.source or 'trace'}: no requests to bin")
        num_bins = int(np.floor(self.duration_s / bin_s)) + 1
        idx = np.minimum((self.arrival_s // bin_s).astype(np.int64), num_bins - 1)
        count = np.bincount(idx, minlength=num_bins).astype(np.float64)
        tin = np.bincount(idx, weights=self.input_tokens, minlength=num_bins)
        tout = np.bincount(idx, weights=self.output_tokens, minlength=num_bins)
        return DemandSeries(
            bin_s=bin_s,
            req_per_s=count / bin_s,
            input_tok_per_s=tin / bin_s,
            output_tok_per_s=tout / bin_s,
            arrival_cv=_binned_cv(self.arrival_s, idx, num_bins),
            source=self.source,
            start_epoch_s=self.start_epoch_s,
        )


def _binned_cv(arrival_s: np.ndarray, idx: np.ndarray, num_bins: int) -> np.ndarray:
    """Inter-arrival coefficient of variation inside each bin (1.0 where too few arrivals)."""
    gaps = np.diff(arrival_s)
    gap_bin = idx[1:]
    same = idx[1:] == idx[:-1]
    gaps, gap_bin = gaps[same], gap_bin[same]
    n = np.bincount(gap_bin, minlength=num_bins)
    s1 = np.bincount(gap_bin, weights=gaps, minlength=num_bins)
    s2 = np.bincount(gap_bin, weights=gaps * gaps, minlength=num_bins)
    cv = np.ones(num_bins)
    ok = n >= 5
    mean = s1[ok] / n[ok]
    var = np.maximum(s2[ok] / n[ok] - mean * mean, 0.0)
    cv[ok] = np.sqrt(var) / np.maximum(mean, 1e-12)
    return cv


@dataclass(frozen=True)
class DemandSeries:
    """Fixed-width bins of demand; bin i covers [i * bin_s, (i + 1) * bin_s)."""

    bin_s: float
    req_per_s: np.ndarray  # [num_bins]
    input_tok_per_s: np.ndarray  # [num_bins]
    output_tok_per_s: np.ndarray  # [num_bins]
    arrival_cv: np.ndarray | None = None  # [num_bins]
    source: str = ""
    start_epoch_s: float | None = None
    notes: list[str] = field(default_factory=list)  # what loading repaired or how it joined
    # what loading assumed (where request lengths come from), printed by every report
    assumptions: list[str] = field(default_factory=list)
    prompt_log_sigma: float | None = None  # spread of log prompt lengths, when known

    def __post_init__(self) -> None:
        n = len(self.req_per_s)
        for name in ("input_tok_per_s", "output_tok_per_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} bins, expected {n}")
        if self.bin_s <= 0:
            raise ValueError(f"bin_s must be positive, got {self.bin_s}")

    @property
    def num_bins(self) -> int:
        return len(self.req_per_s)

    @property
    def duration_s(self) -> float:
        return self.num_bins * self.bin_s

    @property
    def times_s(self) -> np.ndarray:
        return np.arange(self.num_bins) * self.bin_s

    def cv(self) -> np.ndarray:
        return self.arrival_cv if self.arrival_cv is not None else np.ones(self.num_bins)

    def scaled(self, factor: float) -> DemandSeries:
        """Rates ``factor`` times as high (request sizes and arrival variability kept)."""
        if factor <= 0:
            raise ValueError(f"a demand scale must be positive, got {factor:g}")
        return replace(
            self,
            req_per_s=self.req_per_s * factor,
            input_tok_per_s=self.input_tok_per_s * factor,
            output_tok_per_s=self.output_tok_per_s * factor,
        )

    def slice(self, start: int, stop: int) -> DemandSeries:
        """Bins [start, stop) as a new series (times restart at 0, the epoch moves)."""
        epoch = None if self.start_epoch_s is None else self.start_epoch_s + start * self.bin_s
        return DemandSeries(
            bin_s=self.bin_s,
            req_per_s=self.req_per_s[start:stop],
            input_tok_per_s=self.input_tok_per_s[start:stop],
            output_tok_per_s=self.output_tok_per_s[start:stop],
            arrival_cv=None if self.arrival_cv is None else self.arrival_cv[start:stop],
            source=self.source,
            start_epoch_s=epoch,
            notes=list(self.notes),
            assumptions=list(self.assumptions),
            prompt_log_sigma=self.prompt_log_sigma,
        )

    def rebin(self, factor: int) -> DemandSeries:
        """Merge `factor` consecutive bins (rates are averaged; a partial last bin is dropped)."""
        if factor <= 1:
            return self
        n = (self.num_bins // factor) * factor
        if n == 0:
            raise ValueError(f"cannot rebin {self.num_bins} bins by {factor}")

        def avg(a: np.ndarray) -> np.ndarray:
            return a[:n].reshape(-1, factor).mean(axis=1)

        return DemandSeries(
            bin_s=self.bin_s * factor,
            req_per_s=avg(self.req_per_s),
            input_tok_per_s=avg(self.input_tok_per_s),
            output_tok_per_s=avg(self.output_tok_per_s),
            arrival_cv=None if self.arrival_cv is None else avg(self.arrival_cv),
            source=self.source,
            start_epoch_s=self.start_epoch_s,
            notes=list(self.notes),
            assumptions=list(self.assumptions),
            prompt_log_sigma=self.prompt_log_sigma,
        )
