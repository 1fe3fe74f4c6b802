"""The online autoscaler (what the operator runs) against the simulator's decisions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridllm_forecaster import autoscaler, evaluate, fluid, forecast, loaders, policies
from hybridllm_forecaster.capacity import PoolConfig

SERVEGEN = Path(os.environ["HYBRIDLLM_TRACES"]) / "servegen-2025"
AGGREGATE = SERVEGEN / "m-large-aggregate-10min.csv"


class Recording(policies.Policy):
    """The simulator's policy, with every observation it was asked about and its answer."""

    def __init__(self, inner: policies.Policy) -> None:
        self.inner, self.name = inner, inner.name
        self.calls: list[tuple[policies.Observation, int]] = []

    def decide(self, obs: policies.Observation) -> int:
        desired = self.inner.decide(obs)
        self.calls.append((obs, desired))
        return desired


def _scaler(
    pool: PoolConfig, mode: str, bin_s: float, model: str, view: Any = policies.live_view
) -> autoscaler.PoolScaler:
    fc = autoscaler.OnlineForecast.for_pool(pool, bin_s, model=model)
    return autoscaler.PoolScaler(pool, mode, fc, view)  # type: ignore[arg-type]


@pytest.mark.dev_traces("servegen-2025/m-large-aggregate-10min.csv")
@pytest.mark.parametrize(("mode", "family"), [("hybrid", "predictive+floor"), ("reactive", "hpa"),
                                              ("predictive", "predictive")])  # fmt: skip
def test_online_loop_replays_a_servegen_day_with_the_simulators_decisions(mode, family):
    """A day of the ServeGen trace through the fluid simulator, then the same observations
    through the online autoscaler on a fake clock, its forecast fed one complete bin at a
    time and its state saved and restored (an operator restart) every simulated hour: the
    same replica count at every control interval once the forecast has its first four
    bins (5,600 of the day's 5,760). The simulator offers the load as it comes, so here
    the online policies read it through the simulator's model of the metrics pipeline
    (online they read a real metric, late already, as it is)."""
    demand, _ = loaders.load_demand(AGGREGATE)
    day = demand.slice(288, 288 + 144)  # the trace's third day, 10-minute bins
    pool = PoolConfig(min_replicas=1, max_replicas=1000, cold_start_s=180.0)
    y = pool.work_series(day)
    bin_s = day.bin_s
    model = "last"
    online = _scaler(pool, mode, bin_s, model, policies.MetricView)
    fc = forecast.run_model(model, y, online.forecast.spec())
    truth = y[np.arange(int(day.duration_s // 15)) * 15 // int(bin_s)]
    sim_policy = Recording(
        evaluate.make_policy(
            family,
            pool.target_utilisation,
            pool,
            fc.upper,
            bin_s,
            0.0,
            truth,
            pool.control_interval_s,
            bin_s,
            0.0,
        )
    )
    if family == "hpa":  # the operator's reactive mode uses the pool's own window
        assert sim_policy.inner.behaviour.down_window_s == pool.scale_down_stabilisation_s
    result = fluid.simulate_fluid(day, pool, sim_policy, initial_replicas=40)
    assert len(sim_policy.calls) == 5760
    assert len({d for _, d in sim_policy.calls}) > 10, "the day must move the pool"

    mismatches = []
    for k, (obs, want) in enumerate(sim_policy.calls):
        if k % 240 == 0 and k:  # an hour: the operator restarts from its saved state
            saved = online.state()
            online = _scaler(pool, mode, bin_s, model, policies.MetricView)
            online.restore(saved)
        complete = int(obs.now_s // bin_s)
        online.forecast.update(y[:complete], 0.0)
        got = online.decide(
            obs.now_s, obs.ready, obs.provisioned, autoscaler.Reading(obs.work_per_s, obs.in_flight)
        )
        # Before four complete bins the simulator peeks at the first bin's forecast; the
        # online loop has none yet and plans from the measured load: compare after that.
        if complete >= autoscaler.MIN_FORECAST_BINS and got.desired != want:
            mismatches.append((k, obs.now_s, want, got.desired, got.reason))
    assert not mismatches, mismatches[:5]
    assert result.replica_hours > 0


def test_without_a_metric_it_holds_and_says_so():
    pool = PoolConfig(min_replicas=1, max_replicas=10)
    scaler = _scaler(pool, "hybrid", 60.0, "last")
    for work in (None, float("nan"), float("inf")):
        d = scaler.decide(0.0, 3, 3, autoscaler.Reading(work))
        assert (d.desired, d.metrics_available) == (3, False)
        assert "no load metric" in d.reason
    # zero is real load: the pool decays to its minimum (after the HPA floor's window)
    assert scaler.decide(0.0, 3, 3, autoscaler.Reading(2.0)).desired == 3
    for t in range(15, 75, 15):  # the metric is read one scrape late, over two scrapes
        d = scaler.decide(float(t), 3, 3, autoscaler.Reading(0.0))
    assert d.metrics_available, d
    assert (d.reactive, d.predictive) == (3, 1), d
    d = scaler.decide(pool.scale_down_stabilisation_s + 30, 3, 3, autoscaler.Reading(0.0))
    assert d.desired == 1, d.reason


def test_pending_pods_stop_further_scale_up_and_the_status_says_why():
    pool = PoolConfig(min_replicas=1, max_replicas=10)
    scaler = _scaler(pool, "reactive", 60.0, "last")
    d = scaler.decide(0.0, 2, 3, autoscaler.Reading(7.0), unschedulable=1)
    assert d.recommended is not None
    assert d.recommended > 3
    assert d.desired == 3
    assert d.capacity_bound
    assert "1 pod(s) cannot be scheduled" in d.reason


def test_advisory_decides_like_hybrid_and_changes_nothing():
    pool = PoolConfig(min_replicas=1, max_replicas=10)
    advisory = _scaler(pool, "advisory", 60.0, "last")
    hybrid = _scaler(pool, "hybrid", 60.0, "last")
    for t, work in enumerate([1.0, 4.0, 6.5, 6.5, 2.0]):
        a = advisory.decide(t * 15.0, 2, 2, autoscaler.Reading(work))
        h = hybrid.decide(t * 15.0, 2, 2, autoscaler.Reading(work))
        assert a.recommended == h.desired
        assert a.desired == 2
        assert a.reason.startswith("advisory, not applied")


@pytest.mark.parametrize("mode", ["reactive", "predictive", "hybrid", "advisory"])
def test_a_pool_at_zero_wakes_on_waiting_requests_and_otherwise_stays_down(mode):
    pool = PoolConfig(min_replicas=0, max_replicas=10)
    scaler = _scaler(pool, mode, 60.0, "last")
    for t in range(0, 600, 15):  # idle at zero: no flapping back to one
        d = scaler.decide(float(t), 0, 0, autoscaler.Reading(0.0))
        assert (d.desired, d.recommended) == (0, 0), d
    d = scaler.decide(600.0, 0, 0, autoscaler.Reading(0.0, waiting=2))
    assert d.recommended == 1
    assert "scale from zero to 1: 2 request(s) waiting" in d.reason
    assert d.desired == (0 if mode == "advisory" else 1)
    held = scaler.decide(615.0, 0, 0, autoscaler.Reading(None, waiting=2))
    assert held.desired == 0  # no metrics: hold, even at zero
    # idle again with one replica: back to zero after the reactive window
    for t in range(630, 630 + 400, 15):
        d = scaler.decide(float(t), 1, 1, autoscaler.Reading(0.0))
    assert d.recommended == 0, d


@pytest.mark.parametrize("mode", ["off", "external"])
def test_off_and_external_leave_replicas_alone(mode):
    scaler = _scaler(PoolConfig(min_replicas=1, max_replicas=10), mode, 60.0, "last")
    d = scaler.decide(0.0, 2, 7, autoscaler.Reading(100.0))
    assert (d.desired, d.recommended) == (7, None)
    assert mode in d.reason


def test_a_state_saved_under_another_mode_is_not_taken():
    pool = PoolConfig(min_replicas=1, max_replicas=10)
    hybrid = _scaler(pool, "hybrid", 60.0, "last")
    hybrid.decide(0.0, 5, 5, autoscaler.Reading(3.0))
    reactive = _scaler(pool, "reactive", 60.0, "last")
    reactive.restore(hybrid.state())
    assert reactive.state()["policy"] == {"metric": [], "recent": []}


# ---------------------------------------------------------------- properties

MODES = st.sampled_from(["reactive", "predictive", "hybrid"])
LOADS = st.lists(
    st.one_of(st.none(), st.floats(min_value=0.0, max_value=500.0)), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(
    mode=MODES,
    lo=st.integers(0, 20),
    span=st.integers(0, 40),
    start=st.integers(0, 80),
    loads=LOADS,
    pending=st.lists(st.integers(0, 3), min_size=60, max_size=60),
)
def test_decisions_stay_within_bounds(mode, lo, span, start, loads, pending):
    pool = PoolConfig(min_replicas=lo, max_replicas=max(1, lo + span))
    scaler = _scaler(pool, mode, 60.0, "last")
    current = min(max(start, pool.min_replicas), pool.max_replicas)
    history: list[float] = []
    for k, work in enumerate(loads):
        now = 15.0 * k
        scaler.forecast.update(history, 0.0)
        d = scaler.decide(now, current, current, autoscaler.Reading(work), unschedulable=pending[k])
        assert pool.min_replicas <= d.desired <= pool.max_replicas
        if pending[k] and d.desired > current:
            raise AssertionError(f"scaled up with {pending[k]} unschedulable pods: {d}")
        if work is None:
            assert d.desired == current
        current = d.desired
        if k % 4 == 3:
            history.append(work or 0.0)


@settings(max_examples=150, deadline=None)
@given(
    mode=MODES,
    start=st.integers(1, 40),
    loads=st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=1, max_size=40),
)
def test_no_scale_down_while_the_slo_is_violated(mode, start, loads):
    pool = PoolConfig(min_replicas=1, max_replicas=60, scale_down_stabilisation_s=0.0)
    scaler = _scaler(pool, mode, 60.0, "last")
    current = start
    for k, work in enumerate(loads):
        d = scaler.decide(15.0 * k, current, current, autoscaler.Reading(work, slo_violation="x"))
        assert d.desired >= current, d
        current = d.desired


def test_a_saturated_pool_grows_one_ready_replica_at_a_time_and_says_why_it_cannot():
    """The new-user run of issue #52: a token rate the capacity calls light, while the TTFT
    breaks the SLO and requests are turned away. One replica more once the last one is
    ready, none beyond maxReplicas or unschedulable pods (each said), and after the burst
    one scale-down window before the policy shrinks the pool again: no flapping."""
    pool = PoolConfig(min_replicas=1, max_replicas=3, scale_down_stabilisation_s=60.0)
    scaler = _scaler(pool, "reactive", 60.0, "last")
    burst = autoscaler.Reading(0.1, slo_violation="cloud p95 TTFT 51 s > 1 s", overloaded=34)
    d = scaler.decide(0.0, 1, 1, burst)
    assert (d.recommended, d.desired, d.cause) == (1, 2, "scale up: saturated")
    assert "cloud p95 TTFT 51 s > 1 s; 34 request(s) answered 503 (overloaded)" in d.reason
    d = scaler.decide(15.0, 1, 2, burst)  # the new replica is starting
    assert (d.desired, d.cause) == (2, "hold: saturated, replicas starting")
    d = scaler.decide(30.0, 2, 2, burst, unschedulable=1)
    assert (d.desired, d.capacity_bound) == (2, True)
    assert "capacity-bound while saturated" in d.reason
    d = scaler.decide(45.0, 2, 2, burst)
    assert d.desired == 3
    d = scaler.decide(60.0, 3, 3, burst)
    assert (d.desired, d.cause) == (3, "hold: saturated at maxReplicas")
    assert "raise maxReplicas" in d.reason
    quiet = autoscaler.Reading(0.1)
    sizes = [scaler.decide(75.0 + 15.0 * k, 3, 3, quiet).desired for k in range(3)]
    assert sizes == [3, 3, 3]  # inside the scale-down window after the burst
    later = [scaler.decide(180.0 + 15.0 * k, 3, 3, quiet) for k in range(8)]
    assert later[-1].desired < 3  # then the policy decides again


@settings(max_examples=100, deadline=None)
@given(
    mode=MODES,
    start=st.integers(1, 40),
    work=st.floats(min_value=0.0, max_value=20.0),
    cold_steps=st.integers(0, 20),
)
def test_constant_load_changes_direction_at_most_once(mode, start, work, cold_steps):
    """Under constant load, replicas move one way (perhaps in steps) and then stay: no
    flapping between N and N-1. Pods take ``cold_steps`` intervals to become ready."""
    pool = PoolConfig(min_replicas=1, max_replicas=60)
    scaler = _scaler(pool, mode, 60.0, "last")
    provisioned, starting = start, []  # ready-at step of each starting pod
    ready = start
    counts, history = [start], []
    for k in range(160):
        ready += sum(1 for s in starting if s == k)
        starting = [s for s in starting if s > k]
        if k % 4 == 0 and k:
            history.append(work)
        scaler.forecast.update(history, 0.0)
        d = scaler.decide(15.0 * k, ready, provisioned, autoscaler.Reading(work))
        if d.desired > provisioned:
            starting += [k + cold_steps] * (d.desired - provisioned)
        elif d.desired < provisioned:
            drop = provisioned - d.desired
            keep = max(0, len(starting) - drop)
            drop -= len(starting) - keep
            starting = starting[:keep]
            ready -= drop
        provisioned = d.desired
        counts.append(provisioned)
    steps = np.sign(np.diff(counts))
    moves = steps[steps != 0]
    assert int(np.sum(moves[1:] != moves[:-1])) <= 1, counts
    # it does carry the load (the HPA's 10% tolerance may leave it just short)
    need = min(work / pool.target_utilisation, 60)
    assert counts[-1] * (1 + policies.HPA_TOLERANCE) >= need - 1e-6, counts


def test_hybrid_raises_the_pool_before_a_daily_rise_and_reactive_after_it():
    """Four days of a demand that steps from 10 to 40 replicas' worth at 09:00 every day,
    through the online loop (Holt-Winters learns the daily season from the bins it is fed):
    on the fourth day, hybrid scales up one lead time before 09:00, reactive after."""
    bin_s, per_day, days = 600.0, 144, 4
    hour = (np.arange(days * per_day) % per_day) / 6.0
    work = np.where((hour >= 9) & (hour < 17), 40.0, 10.0)
    pool = PoolConfig(min_replicas=1, max_replicas=200, cold_start_s=600.0)
    first_up = {}
    for mode in ("reactive", "hybrid"):
        scaler = _scaler(pool, mode, bin_s, "holt-winters")
        current, ups = 15, []
        for k in range(int(days * per_day * bin_s // 15)):
            now = k * 15.0
            b = int(now // bin_s)
            if k % 40 == 0:
                scaler.forecast.update(work[:b], 0.0)
            d = scaler.decide(now, current, current, autoscaler.Reading(float(work[b])))
            if d.desired > current and now >= 3 * 86_400:
                ups.append((now - 3 * 86_400) / 3600)
            current = d.desired
        first_up[mode] = ups[0]
    lead_h = pool.lead_time_s / 3600
    assert 9.0 - lead_h - 0.05 <= first_up["hybrid"] < 9.0, first_up
    assert first_up["reactive"] >= 9.0, first_up


@pytest.mark.parametrize("mode", ["reactive", "predictive", "hybrid", "advisory", "off"])
def test_the_cause_of_a_decision_takes_few_values_and_no_numbers(mode):
    """A day of changing load, pods that cannot be scheduled, an SLO violation, a pool at
    zero and missing metrics: the reasons carry numbers and take many values; the causes
    (a metric label) take a few fixed ones."""
    pool = PoolConfig(min_replicas=0, max_replicas=50)
    scaler = _scaler(pool, mode, 60.0, "last")
    rng = np.random.default_rng(0)
    provisioned, reasons, causes = 5, set(), set()
    capacity = pool.target_utilisation  # the work one replica carries at its target
    for k in range(2000):
        now = k * 15.0
        work = capacity * max(0.0, 10 + 8 * np.sin(now / 3000) + rng.normal(0, 2))
        if k % 97 == 0:
            work = None  # a failed scrape
        if 900 <= k < 960:
            work = 0.0  # idle: the pool may go to zero and wake on waiting requests
        scaler.forecast.update(np.full(k // 4, capacity * 10.0), 0.0)
        d = scaler.decide(
            now, provisioned, provisioned,
            autoscaler.Reading(work, slo_violation="p95 TTFT 3 s > 1 s" if k % 50 == 1 else None,
                               waiting=2.0 if 960 <= k < 970 else 0.0),
            unschedulable=3 if k % 33 == 0 else 0,
        )  # fmt: skip
        provisioned = d.desired
        reasons.add(d.reason)
        causes.add(d.cause)
    assert all(not any(ch.isdigit() for ch in c) for c in causes), causes
    assert len(causes) <= 12, causes
    if mode != "off":
        assert len(reasons) > 2 * len(causes), (len(reasons), causes)


def test_a_compressed_season_is_learned_when_the_forecast_is_told_its_length():
    """A 'day' of ten minutes in 20 s bins (quiet, then a rise in its last third), three
    of them: told the season is ten minutes, the forecast from just before the third
    rise sees it coming; with the default day for a season it sees only the quiet."""
    bin_s, per_day = 20.0, 30
    phase = np.arange(3 * per_day) % per_day
    work = np.where(phase >= 20, 40.0, 5.0)
    pool = PoolConfig(min_replicas=1, max_replicas=200, cold_start_s=60.0)
    before = 2 * per_day + 17  # three bins before the third rise
    seen = {}
    for season_s in (per_day * bin_s, forecast.DAY_S):
        fc = autoscaler.OnlineForecast.for_pool(pool, bin_s, season_s=season_s)
        assert fc.spec().period == round(season_s / bin_s)
        fc.update(work[:before], 0.0)
        now = before * bin_s
        seen[season_s] = fc.forecast_max(now, now + pool.lead_time_s)
    assert seen[per_day * bin_s] >= 30.0, seen  # the rise, a lead time ahead
    assert seen[forecast.DAY_S] < 20.0, seen  # no season: the quiet goes on


@pytest.mark.parametrize("mode", ["reactive", "hybrid"])
def test_online_a_real_metric_is_read_as_it_is_not_delayed_again(mode):
    """The operator's demand is a Prometheus rate (or counters it reads itself): already
    late and averaged. The policies act on the reading at once, where the simulator's
    model of that pipeline (a 15 s delay, a 30 s window) would answer a step of load
    only readings later."""
    pool = PoolConfig(min_replicas=1, max_replicas=100)
    first_up = {}
    for name, view in (("live", policies.live_view), ("modelled", policies.MetricView)):
        scaler = _scaler(pool, mode, 600.0, "last", view)
        current = 2
        for k in range(20):
            now = k * 15.0
            work = 1.0 if now < 150 else 20.0  # a step of load at 150 s
            d = scaler.decide(now, current, current, autoscaler.Reading(work))
            if d.desired > current and name not in first_up:
                first_up[name] = now
            current = d.desired
    assert first_up["live"] == 150.0, first_up
    assert first_up["modelled"] > 150.0, first_up


@settings(max_examples=300, deadline=None)
@given(
    pools=st.lists(
        st.tuples(
            st.integers(0, 3),  # GPUs per replica
            st.integers(0, 4),  # minReplicas
            st.integers(0, 12),  # current above the minimum
            st.integers(0, 12),  # wanted above the minimum
        ),
        min_size=1,
        max_size=4,
    ),
    slack=st.integers(0, 40),
)
def test_fit_budget_stays_within_it_keeps_every_cut_and_wastes_no_gpu(pools, slack) -> None:
    names = [f"p{i}" for i in range(len(pools))]
    gpus = {n: g for n, (g, _, _, _) in zip(names, pools, strict=True)}
    low = {n: m for n, (_, m, _, _) in zip(names, pools, strict=True)}
    current = {n: m + c for n, (_, m, c, _) in zip(names, pools, strict=True)}
    want = {n: m + w for n, (_, m, _, w) in zip(names, pools, strict=True)}
    budget = sum(low[n] * gpus[n] for n in names) + slack  # the minimums fit (validated)
    fit = autoscaler.fit_budget(want, current, low, gpus, budget)
    used = sum(fit[n] * gpus[n] for n in names)
    assert used <= budget
    for n in names:
        assert low[n] <= fit[n] <= want[n]
        if gpus[n] == 0:
            assert fit[n] == want[n]  # a pool without GPUs is never held back
        if sum(min(want[m], current[m]) * gpus[m] for m in names) <= budget:
            assert fit[n] >= min(want[n], current[n])  # within budget, no pool loses replicas
        if fit[n] < want[n]:
            assert gpus[n] > budget - used  # its next replica would not fit
