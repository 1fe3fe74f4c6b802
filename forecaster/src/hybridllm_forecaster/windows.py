"""When a rollout may start: the forecast's low-demand windows, and a schedule.

A rollout takes capacity (a canary's cold start, the stable pools' rolling update) for
a time that is known before it starts: the sum of its steps' pauses plus the new
replicas' cold start. Started just before the daily peak, it runs through it. This
module answers one question for the rollout controller: *given what demand looks like
by time of day, and the hours the operator allows, when should a rollout of this length
start?*

The forecast is a `DayProfile`: for each bin of the day (UTC), the upper quantile (P90
by default) and the median of the demand seen in that bin over the last days. It is
the one-day seasonal view of the history the autoscaler already keeps; unlike the
autoscaler's short-horizon forecast it reaches a day ahead, which is what planning a
start needs, and it is plain enough to explain in a status message ("demand below 40%
of the daily peak from 02:10 to 03:40 UTC").

`plan_start` scans candidate starts, one bin apart, from now to now plus the longest
wait allowed, and takes the first that (a) falls inside the schedule, if one is given,
and (b) keeps the forecast P90 below the given share of the daily P90 peak for the
rollout's whole duration, if a share is given. With less than a day of history the
share cannot be judged: the plan follows the schedule alone and says so. When no
candidate qualifies, the rollout starts at the latest allowed moment, and the plan says
that too: a rollout is delayed, never blocked for good.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DAY_S = 86_400.0
PROFILE_DAYS = 7  # the days a profile looks back over (a week: every weekday once)


@dataclass(frozen=True)
class DayProfile:
    """Demand by time of day (UTC): bin ``k`` covers ``[k * bin_s, (k + 1) * bin_s)`` of
    each day; ``upper`` and ``p50`` are quantiles over the days seen."""

    bin_s: float
    upper: np.ndarray
    p50: np.ndarray
    days: int  # complete days the quantiles were taken over

    @classmethod
    def from_history(
        cls,
        bins: Sequence[float],
        bin_s: float,
        start_s: float,
        *,
        upper_q: float = 0.9,
        days: int = PROFILE_DAYS,
    ) -> DayProfile | None:
        """The profile of the last ``days`` days of ``bins`` (bin 0 began at Unix time
        ``start_s``); None with less than one whole day of history."""
        if bin_s <= 0:
            raise ValueError(f"bin_s must be positive, got {bin_s}")
        per_day = int(DAY_S // bin_s)  # a bin that does not divide a day: the last is wider
        y = np.maximum(np.nan_to_num(np.asarray(bins, dtype=float), nan=0.0), 0.0)
        seen = min(days, len(y) // per_day)
        if seen < 1:
            return None
        y = y[len(y) - seen * per_day :]
        first = start_s + (len(bins) - len(y)) * bin_s  # Unix time of y[0]
        # Row d, column k: the demand in bin k of the UTC day, on the d-th day touched
        # (``seen`` whole days span at most seen + 1 calendar days).
        t = first + np.arange(len(y)) * bin_s
        day = np.floor(t / DAY_S).astype(int)
        grid = np.full((seen + 1, per_day), np.nan)
        column = np.minimum(np.floor((t % DAY_S) / bin_s).astype(int), per_day - 1)
        grid[day - day[0], column] = y
        upper = np.nanquantile(grid, upper_q, axis=0)
        p50 = np.nanquantile(grid, 0.5, axis=0)
        return cls(bin_s=bin_s, upper=upper, p50=p50, days=seen)

    @property
    def peak(self) -> float:
        """The day's highest upper-quantile bin."""
        return float(np.max(self.upper))

    def max_over(self, from_s: float, to_s: float) -> float:
        """The highest upper-quantile bin touching ``[from_s, to_s]`` (Unix times)."""
        if to_s - from_s >= DAY_S:
            return self.peak
        # one time in each bin touched (a step of one bin never skips one), and the end
        ts = np.append(np.arange(from_s, to_s, self.bin_s), max(from_s, to_s - 1e-6))
        cols = np.minimum(np.floor((ts % DAY_S) / self.bin_s).astype(int), len(self.upper) - 1)
        return float(np.max(self.upper[cols]))


@dataclass(frozen=True)
class Window:
    """When rollouts may start. ``schedule``: ranges of the UTC day, in seconds since
    midnight (a range may wrap past midnight: (22h, 2h)); ``below_peak``: the share of
    the daily P90 peak the forecast must stay under for the whole rollout; ``max_delay_s``:
    the longest a rollout waits for either."""

    schedule: tuple[tuple[float, float], ...] = ()
    below_peak: float | None = None
    max_delay_s: float = DAY_S

    def __post_init__(self) -> None:
        for a, b in self.schedule:
            if not (0 <= a < DAY_S and 0 <= b <= DAY_S) or a == b:
                raise ValueError(f"schedule range {a}-{b} is not a range within one day")
        if self.below_peak is not None and not 0 < self.below_peak <= 1:
            raise ValueError(f"below_peak must be in (0, 1], got {self.below_peak}")
        if self.max_delay_s < 0:
            raise ValueError("max_delay_s must not be negative")

    def in_schedule(self, t_s: float) -> bool:
        if not self.schedule:
            return True
        tod = t_s % DAY_S
        return any(a <= tod < b if a < b else (tod >= a or tod < b) for a, b in self.schedule)


@dataclass(frozen=True)
class Planned:
    """A planned start and why it is then."""

    start_s: float
    reason: str
    forecast_max: float | None = None  # the forecast P90 peak over the planned rollout
    forecast_peak: float | None = None  # the day's P90 peak


def plan_start(
    now_s: float,
    duration_s: float,
    window: Window,
    profile: DayProfile | None,
    step_s: float = 60.0,
    since_s: float | None = None,
) -> Planned:
    """The first start from ``now_s`` that the window allows for a rollout lasting
    ``duration_s`` (see the module's docstring). ``since_s``: when the rollout began to
    wait (default: now); the longest wait counts from then, so a plan made again at
    every look still ends."""
    step = profile.bin_s if profile is not None else step_s
    latest = max(now_s, (now_s if since_s is None else since_s) + window.max_delay_s)
    limit = None  # the forecast P90 a rollout must stay under (None: not judged)
    if window.below_peak is not None and profile is not None and profile.peak > 0:
        limit = window.below_peak * profile.peak
    # Candidates: now, then every bin boundary (and schedule opening) up to the latest.
    candidates = [now_s, *np.arange(math.floor(now_s / step) * step + step, latest, step)]
    for a, _ in window.schedule:
        day = math.floor(now_s / DAY_S) * DAY_S
        candidates += [t for t in (day + a, day + a + DAY_S) if now_s < t <= latest]
    for t in sorted(float(c) for c in candidates):
        if not window.in_schedule(t):
            continue
        if limit is not None and profile is not None:
            during = profile.max_over(t, t + duration_s)
            if during > limit:
                continue
            return Planned(
                t,
                f"forecast demand stays at or below {during / profile.peak:.0%} of the daily "
                f"peak for the rollout's {duration_s / 60:.0f} min",
                during,
                profile.peak,
            )
        if window.below_peak is not None:
            why = (
                "no demand history of a whole day yet"
                if profile is None
                else "no demand in the history"
            )
            return Planned(t, f"{why}: the start follows the schedule alone")
        return Planned(t, "within the schedule" if window.schedule else "no window: at once")
    peak = profile.peak if profile is not None else None
    return Planned(
        latest,
        f"no start in the next {window.max_delay_s / 3600:g} h meets the window: "
        "starting at the latest allowed",
        profile.max_over(latest, latest + duration_s) if profile is not None else None,
        peak,
    )
