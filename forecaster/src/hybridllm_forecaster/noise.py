"""The noise band of a verdict: a paired block bootstrap of the test period.

A verdict compares two families on the test period: a family's SLO attainment at the
reference's replica-hours (interpolated along the family's sweep of targets), and its
replica-hours at the reference's attainment. How much those two numbers would move had
the test period been a different stretch of the same traffic is measured on the
comparison itself: the test period is cut into blocks (`block_layout`: a day each when it
spans a week or more, else a twelfth of it but at least two lead times), every
simulation of the test period is summed per block (requests, requests meeting the SLO,
replica-hours), and `RESAMPLES` resamples draw blocks with replacement (the same draw for
every run, so the comparison stays paired) from a generator seeded with `SEED`. In each
resample the two comparisons are recomputed from the resampled sweeps; the band is half
the width of the central `CONFIDENCE` interval of the resampled differences. A difference
inside its band is "no difference".

Blocks are longer than anything a policy remembers (its lead time, its scale-down
window), and the bootstrap is deterministic: the same runs give the same band.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from hybridllm_forecaster.simresult import SimResult

DAY_S = 86_400.0
RESAMPLES = 5000
SEED = 0
# The report states 7 comparisons (hpa-tuned, predictive, predictive+floor and the oracle
# against the HPA; the last three against hpa-tuned), each judged on two differences: the
# bands hold jointly at 95% (Bonferroni: each at 1 - 0.05 / 14), so that among a report's
# 14 differences one with no effect behind it is called "better" or "worse" in at most 5%
# of reports, not in half of them.
JOINT_CONFIDENCE = 0.95
NUM_DIFFERENCES = 14
CONFIDENCE = 1 - (1 - JOINT_CONFIDENCE) / NUM_DIFFERENCES
TARGET_BLOCKS = 12  # blocks of a test period shorter than a week
WEEK_BLOCKS = 7  # a test period of this many days or more is cut into days
MIN_BLOCK_LEADS = 2.0  # a block spans at least this many lead times
MIN_FINITE = 0.5  # resamples where the comparison exists (inside the sweep), or no band


def block_layout(duration_s: float, step_s: float, lead_time_s: float) -> tuple[float, int]:
    """Block length (s) and number of blocks of a test period: whole days when it spans
    `WEEK_BLOCKS` days or more (the daily cycle stays within a block), else a twelfth of
    it, but at least `MIN_BLOCK_LEADS` lead times; rounded to control steps. The rest of
    the period joins the last block."""
    if duration_s >= WEEK_BLOCKS * DAY_S:
        block = DAY_S
    else:
        block = max(duration_s / TARGET_BLOCKS, MIN_BLOCK_LEADS * lead_time_s, step_s)
        block = max(step_s, round(block / step_s) * step_s)
    return block, max(1, int(duration_s // block))


@dataclass
class RunBlocks:
    """One simulation of the test period summed per block."""

    requests: np.ndarray
    met: np.ndarray
    hours: np.ndarray


def run_blocks(
    r: SimResult, requests_per_step: np.ndarray, step_s: float, block_s: float, num_blocks: int
) -> RunBlocks:
    """`r`'s requests, requests meeting the SLO and replica-hours per block.

    ``requests_per_step[k]``: the requests the run's attainment of control interval ``k``
    is over (those it counts). Replica-hours past the last block's start (a simulator that
    runs on until every request has finished) fall in the last block, so the blocks sum
    to ``r.replica_hours``."""
    att = np.asarray(r.attainment, dtype=float)
    w = np.zeros(len(att))
    m = min(len(att), len(requests_per_step))
    w[:m] = requests_per_step[:m]
    idx = np.minimum((np.arange(len(att)) * step_s // block_s).astype(int), num_blocks - 1)
    requests = np.bincount(idx, weights=w, minlength=num_blocks)[:num_blocks]
    met = np.bincount(idx, weights=w * att, minlength=num_blocks)[:num_blocks]
    edges = np.arange(num_blocks + 1) * block_s
    edges[-1] = max(r.duration_s, edges[-2])
    cum = _integral_at(r.replica_changes, edges)
    return RunBlocks(requests, met, np.diff(cum) / 3600.0)


def _integral_at(changes: list[tuple[float, int]], times: np.ndarray) -> np.ndarray:
    """Replica-seconds of a (time, count) step function from 0 to each of `times`."""
    if not changes:
        return np.zeros(len(times))
    t = np.array([c[0] for c in changes], dtype=float)
    c = np.array([c[1] for c in changes], dtype=float)
    at_change = np.concatenate([[0.0], np.cumsum(c[:-1] * np.diff(t))])
    i = np.maximum(np.searchsorted(t, times, side="right") - 1, 0)
    return np.where(times > t[0], at_change[i] + c[i] * (times - t[i]), 0.0)


def attainment_at_cost(pts: list[tuple[float, float]], hours: float) -> float:
    """Attainment at `hours` along (replica-hours, attainment) points; NaN outside them."""
    pts = sorted(pts)
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if not xs[0] <= hours <= xs[-1]:
        return math.nan
    return float(np.interp(hours, xs, ys))


def cost_at_attainment(pts: list[tuple[float, float]], attainment: float) -> float:
    """Cheapest replica-hours at which (replica-hours, attainment) points reach
    `attainment` (linear between neighbours sorted by cost); NaN when none does; the
    cheapest point's cost (an upper bound) when it already does."""
    pts = sorted(pts)
    if pts[0][1] >= attainment:
        return pts[0][0]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y1 >= attainment > y0:
            return x0 + (attainment - y0) / (y1 - y0) * (x1 - x0)
    return math.nan


@dataclass
class Band:
    """Half-widths of the central `CONFIDENCE` interval of the bootstrap differences."""

    slo_points: float  # SLO points at the reference's replica-hours
    cost_ratio: float  # replica-hours at the reference's attainment, over the reference's
    finite_share_points: float = 1.0  # resamples in which each comparison existed
    finite_share_cost: float = 1.0


@dataclass
class Bootstrap:
    """The test period's runs summed per block, and the resampling of the blocks."""

    block_s: float
    num_blocks: int
    runs: dict[str, list[tuple[float, RunBlocks]]] = field(default_factory=dict)
    resamples: int = RESAMPLES
    seed: int = SEED
    confidence: float = CONFIDENCE
    _bands: dict[tuple[str, str, float], Band] = field(default_factory=dict, repr=False)

    def counts(self) -> np.ndarray:
        """[resamples, blocks]: how often each block is drawn in each resample."""
        rng = np.random.default_rng(self.seed)
        draws = rng.integers(0, self.num_blocks, size=(self.resamples, self.num_blocks))
        out = np.zeros((self.resamples, self.num_blocks))
        np.add.at(out, (np.repeat(np.arange(self.resamples), self.num_blocks), draws.ravel()), 1)
        return out

    def _resampled(self, family: str, counts: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for _, b in self.runs[family]:
            req = counts @ b.requests
            att = np.divide(counts @ b.met, req, out=np.ones(len(req)), where=req > 0)
            out.append((counts @ b.hours, att))
        return out

    def band(self, family: str, reference: str, reference_setting: float) -> Band:
        """The band of `family` against `reference` at its chosen setting."""
        key = (family, reference, reference_setting)
        if key not in self._bands:
            self._bands[key] = self._band(family, reference, reference_setting)
        return self._bands[key]

    def _band(self, family: str, reference: str, reference_setting: float) -> Band:
        counts = self.counts()
        sweep = self._resampled(family, counts)
        k = [s for s, _ in self.runs[reference]].index(reference_setting)
        ref_hours, ref_att = self._resampled(reference, counts)[k]
        hours = np.column_stack([h for h, _ in sweep])
        att = np.column_stack([a for _, a in sweep])
        order = _sort_rows(hours, att)
        hours = np.take_along_axis(hours, order, axis=1)
        att = np.take_along_axis(att, order, axis=1)
        points = 100 * (_interp_rows(hours, att, ref_hours) - ref_att)
        with np.errstate(divide="ignore", invalid="ignore"):
            cost = _cost_rows(hours, att, ref_att) / ref_hours
        return Band(
            _half_width(points, self.confidence), _half_width(cost, self.confidence),
            float(np.mean(np.isfinite(points))), float(np.mean(np.isfinite(cost))),
        )  # fmt: skip

    def describe(self) -> dict[str, float | int | str]:
        return {
            "method": "paired block bootstrap of the test period (every run resampled with "
            "the same blocks); band = half the width of the central interval of the "
            "resampled differences",
            "blocks": self.num_blocks,
            "block_s": self.block_s,
            "resamples": self.resamples,
            "seed": self.seed,
            "confidence": self.confidence,
            "joint_confidence": JOINT_CONFIDENCE,
            "differences_judged": NUM_DIFFERENCES,
        }


def _sort_rows(hours: np.ndarray, att: np.ndarray) -> np.ndarray:
    """Per row, the order of (hours, attainment) pairs sorted as `sorted` sorts tuples."""
    return np.array([np.lexsort((a, h)) for h, a in zip(hours, att, strict=True)])


def _interp_rows(hours: np.ndarray, att: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`attainment_at_cost` for every row at once (rows sorted by hours)."""
    inside = (hours[:, 0] <= x) & (x <= hours[:, -1])
    s = hours.shape[1]
    if s == 1:
        return np.where(inside, att[:, 0], np.nan)
    j = np.clip(np.sum(hours <= x[:, None], axis=1) - 1, 0, s - 2)
    rows = np.arange(len(x))
    x0, x1 = hours[rows, j], hours[rows, j + 1]
    y0, y1 = att[rows, j], att[rows, j + 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(x1 > x0, y0 + (x - x0) / (x1 - x0) * (y1 - y0), y1)
    return np.where(inside, y, np.nan)


def _cost_rows(hours: np.ndarray, att: np.ndarray, target: np.ndarray) -> np.ndarray:
    """`cost_at_attainment` for every row at once (rows sorted by hours)."""
    out = np.full(len(target), np.nan)
    first = att[:, 0] >= target
    out[first] = hours[first, 0]
    if hours.shape[1] > 1:
        t = target[:, None]
        cross = (att[:, 1:] >= t) & (t > att[:, :-1])
        j = np.argmax(cross, axis=1)
        found = ~first & cross.any(axis=1)
        rows = np.nonzero(found)[0]
        jj = j[rows]
        x0, x1 = hours[rows, jj], hours[rows, jj + 1]
        y0, y1 = att[rows, jj], att[rows, jj + 1]
        out[rows] = x0 + (target[rows] - y0) / (y1 - y0) * (x1 - x0)
    return out


def _half_width(x: np.ndarray, confidence: float) -> float:
    """Half the central interval of the finite values; infinite (no verdict can pass it)
    when the comparison existed in fewer than `MIN_FINITE` of the resamples."""
    total = x.size
    x = x[np.isfinite(x)]
    if len(x) == 0 or len(x) < MIN_FINITE * total:
        return math.inf
    lo, hi = np.quantile(x, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(hi - lo) / 2
