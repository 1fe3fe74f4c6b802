"""Planning a rollout's start: the day profile, the schedule, the forecast window."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hybridllm_forecaster import windows

SERVEGEN = Path(os.environ["HYBRIDLLM_TRACES"]) / "servegen-2025"
AGGREGATE = SERVEGEN / "m-large-aggregate-10min.csv"
DAY = windows.DAY_S
HOUR = 3600.0
BIN = 600.0
EPOCH = 1_700_006_400.0  # a UTC midnight (2023-11-15)


def daily(days: int, start_s: float = EPOCH) -> tuple[np.ndarray, float]:
    """Demand in 10-minute bins: lowest at 02:00 UTC (10), highest at 14:00 (110)."""
    t = start_s + np.arange(int(days * DAY / BIN)) * BIN
    hours = (t % DAY) / HOUR
    return 60 - 50 * np.cos((hours - 2) / 24 * 2 * np.pi), start_s


def test_the_profile_puts_each_bin_at_its_time_of_day_whatever_the_history_starts_at():
    y, start = daily(3, EPOCH + 5 * HOUR)  # history starting at 05:00 UTC
    profile = windows.DayProfile.from_history(y, BIN, start)
    assert profile is not None
    assert profile.days == 3
    assert len(profile.upper) == DAY / BIN
    assert int(np.argmin(profile.upper)) == 2 * HOUR / BIN  # 02:00
    assert int(np.argmax(profile.upper)) == 14 * HOUR / BIN  # 14:00
    assert profile.peak == pytest.approx(110)
    assert profile.max_over(EPOCH + 1 * HOUR, EPOCH + 3 * HOUR) < 12
    assert profile.max_over(EPOCH, EPOCH + 2 * DAY) == profile.peak
    # less than a day: no profile
    assert windows.DayProfile.from_history(y[:100], BIN, start) is None
    # a bin that does not divide a day: the day's last bin is wider, nothing is lost
    odd = windows.DayProfile.from_history(np.ones(400), 700.0, EPOCH)
    assert odd is not None
    assert len(odd.upper) == DAY // 700
    assert odd.max_over(EPOCH + DAY - 10, EPOCH + DAY + 10) == 1.0


def test_the_upper_quantile_is_taken_over_the_days():
    y, start = daily(7)
    y = y.copy()
    y[int(3 * DAY / BIN + 2 * HOUR / BIN)] = 500  # one day had a spike at 02:00
    profile = windows.DayProfile.from_history(y, BIN, start, upper_q=0.9)
    assert profile is not None
    k = int(2 * HOUR / BIN)
    assert profile.p50[k] == pytest.approx(10)
    assert 10 < profile.upper[k] < 500  # P90 of 7 days feels the spike, not at full height


def test_a_forecast_window_starts_the_rollout_where_demand_stays_low_throughout():
    y, start = daily(3)
    profile = windows.DayProfile.from_history(y, BIN, start)
    now = EPOCH + 3 * DAY + 12 * HOUR  # noon, near the peak
    window = windows.Window(below_peak=0.3)
    planned = windows.plan_start(now, 2 * HOUR, window, profile)
    assert profile is not None
    assert now < planned.start_s < now + DAY
    assert profile.max_over(planned.start_s, planned.start_s + 2 * HOUR) <= 0.3 * profile.peak
    # the first such start: one bin earlier, the rollout would touch a higher bin
    assert profile.max_over(planned.start_s - BIN, planned.start_s - BIN + 2 * HOUR) > (
        0.3 * profile.peak
    )
    assert planned.forecast_peak == pytest.approx(110)
    assert "of the daily peak for the rollout's 120 min" in planned.reason
    # already in the window: at once
    night = EPOCH + 3 * DAY + 1 * HOUR
    assert windows.plan_start(night, HOUR, window, profile).start_s == night


def test_a_schedule_alone_and_one_that_wraps_past_midnight():
    now = EPOCH + 10 * HOUR
    nightly = windows.Window(schedule=((2 * HOUR, 4 * HOUR),))
    planned = windows.plan_start(now, HOUR, nightly, None)
    assert planned.start_s == EPOCH + DAY + 2 * HOUR
    assert planned.reason == "within the schedule"
    late = windows.Window(schedule=((22 * HOUR, 2 * HOUR),))
    assert windows.plan_start(EPOCH + 23 * HOUR, HOUR, late, None).start_s == EPOCH + 23 * HOUR
    assert windows.plan_start(EPOCH + 1 * HOUR, HOUR, late, None).start_s == EPOCH + 1 * HOUR
    assert windows.plan_start(now, HOUR, late, None).start_s == EPOCH + 22 * HOUR
    assert windows.plan_start(now, HOUR, windows.Window(), None).start_s == now
    with pytest.raises(ValueError, match="within one day"):
        windows.Window(schedule=((3 * HOUR, 3 * HOUR),))


def test_without_a_day_of_history_the_schedule_decides_and_the_reason_says_so():
    now = EPOCH + 10 * HOUR
    window = windows.Window(schedule=((2 * HOUR, 4 * HOUR),), below_peak=0.3)
    planned = windows.plan_start(now, HOUR, window, None)
    assert planned.start_s == EPOCH + DAY + 2 * HOUR
    assert planned.reason.startswith("no demand history of a whole day yet")


def test_no_start_meets_the_window_so_it_starts_at_the_latest_allowed():
    y, start = daily(2)
    profile = windows.DayProfile.from_history(y, BIN, start)
    now = EPOCH + 2 * DAY + 12 * HOUR
    window = windows.Window(below_peak=0.05, max_delay_s=6 * HOUR)  # below the daily minimum
    planned = windows.plan_start(now, HOUR, window, profile)
    assert planned.start_s == now + 6 * HOUR
    assert "no start in the next 6 h meets the window" in planned.reason
    # planned again at every look, the longest wait counts from when it began to wait
    for waited in (HOUR, 5 * HOUR, 6 * HOUR, 9 * HOUR):
        again = windows.plan_start(now + waited, HOUR, window, profile, since_s=now)
        assert again.start_s == max(now + waited, now + 6 * HOUR)


@pytest.mark.dev_traces("servegen-2025/m-large-aggregate-10min.csv")
def test_on_servegen_planned_rollouts_run_at_lower_demand_than_rollouts_started_at_random():
    """A week of the ServeGen aggregate builds the profile; on each of the next days, a
    two-hour rollout planned from a random moment runs through less of the real demand
    than one started at that moment."""
    data = np.loadtxt(AGGREGATE, delimiter=",", skiprows=1)
    t, rate = data[:, 0], data[:, 1]
    per_day = int(DAY / BIN)
    rng = np.random.default_rng(7)
    planned_peak, random_peak = [], []
    for day in range(7, int(len(rate) / per_day) - 1):
        history = rate[: day * per_day]
        profile = windows.DayProfile.from_history(history, BIN, float(t[0]))
        assert profile is not None
        for now in float(t[0]) + day * DAY + rng.uniform(0, DAY, size=20):
            plan = windows.plan_start(now, 2 * HOUR, windows.Window(below_peak=0.7), profile)

            def actual(start_s: float) -> float:
                a = int((start_s - t[0]) // BIN)
                return float(np.max(rate[a : a + int(2 * HOUR / BIN) + 1]))

            planned_peak.append(actual(plan.start_s))
            random_peak.append(actual(now))
    assert len(planned_peak) >= 100
    assert np.median(planned_peak) < 0.8 * np.median(random_peak)
