from __future__ import annotations

import numpy as np
import pytest

from hybridllm_forecaster import forecast, metrics

BIN_S = 600.0
PERIOD = 144  # one day of 10-minute bins


def seasonal_series(
    days: int = 8, noise: float = 0.03, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A daily cycle (peak/trough 3x) with small multiplicative noise; returns (noisy, clean)."""
    rng = np.random.default_rng(seed)
    i = np.arange(days * PERIOD)
    clean = 100.0 * (2.0 + np.sin(2 * np.pi * i / PERIOD) + 0.3 * np.sin(4 * np.pi * i / PERIOD))
    return clean * np.exp(rng.normal(0, noise, len(i))), clean


@pytest.mark.parametrize("model", ["holt-winters", "gbm"])
def test_recovers_known_seasonality(model):
    y, clean = seasonal_series()
    split = 5 * PERIOD
    spec = forecast.ForecastSpec(bin_s=BIN_S, horizon=12, train_until=split, refit_every=PERIOD)
    fc = forecast.run_model(model, y, spec)
    last = forecast.run_model("last", y, spec)
    h = 12  # two hours ahead: the cycle moves a lot, the noise is 3%
    ours = {s.horizon: s for s in metrics.score(y, fc, split, [h])}[h]
    base = {s.horizon: s for s in metrics.score(y, last, split, [h])}[h]
    assert ours.wape < 0.5 * base.wape
    assert ours.wape < 0.06  # close to the noise level (3% multiplicative noise)
    origins = np.arange(split, len(y) - h)
    corr = np.corrcoef(fc.p50[origins, h - 1], clean[origins + h])[0, 1]
    assert corr > 0.98


def test_upper_quantile_is_calibrated_roughly():
    y, _ = seasonal_series(noise=0.1)
    split = 5 * PERIOD
    spec = forecast.ForecastSpec(
        bin_s=BIN_S, horizon=2, train_until=split, upper_q=0.9, refit_every=PERIOD
    )
    for model in ("last", "holt-winters", "gbm"):
        fc = forecast.run_model(model, y, spec)
        cov = metrics.score(y, fc, split, [1])[0].coverage_upper
        assert 0.75 <= cov <= 0.99, (model, cov)
        assert np.all(fc.upper >= fc.p50 - 1e-9)


@pytest.mark.parametrize("model", forecast.MODELS)
def test_forecasts_never_look_ahead(model):
    """Changing the future must not change any forecast issued before it (online, causal)."""
    y, _ = seasonal_series(days=5)
    spec = forecast.ForecastSpec(bin_s=BIN_S, horizon=3, train_until=3 * PERIOD, refit_every=100)
    cut = 4 * PERIOD
    y2 = y.copy()
    y2[cut:] *= 5.0
    a = forecast.run_model(model, y, spec)
    b = forecast.run_model(model, y2, spec)
    np.testing.assert_allclose(a.p50[:cut], b.p50[:cut])
    np.testing.assert_allclose(a.upper[:cut], b.upper[:cut])


def test_metrics_values():
    actual = np.array([10.0, 10.0, 20.0])
    pred = np.array([8.0, 12.0, 20.0])
    assert metrics.wape(actual, pred) == pytest.approx(4.0 / 40.0)
    # q=0.9: under-forecast costs 0.9 per unit, over-forecast 0.1 per unit
    assert metrics.pinball(actual, pred, 0.9) == pytest.approx((0.9 * 2 + 0.1 * 2) / 3 / (40 / 3))


def test_ratio_model_anticipates_a_daily_ramp_the_last_value_misses():
    """A sharp morning ramp (x2.5 within 30 minutes) at the same time every day, on top of
    noise: on the bins where demand moves > 20% the gbm must be clearly better than the last
    value (it knows from yesterday's ratio and the time of day that the ramp is due)."""
    rng = np.random.default_rng(1)
    days = 8
    i = np.arange(days * PERIOD)
    tod = i % PERIOD
    level = np.where((tod >= 54) & (tod < 120), 250.0, 100.0)
    level = np.where((tod >= 51) & (tod < 54), 100.0 + 50.0 * (tod - 50), level)  # the ramp
    y = level * np.exp(rng.normal(0, 0.04, len(i)))
    split = 5 * PERIOD
    spec = forecast.ForecastSpec(bin_s=BIN_S, horizon=2, train_until=split, refit_every=PERIOD)
    gbm = {s.horizon: s for s in metrics.score(y, forecast.run_model("gbm", y, spec), split, [1])}
    last = {s.horizon: s for s in metrics.score(y, forecast.run_model("last", y, spec), split, [1])}
    assert last[1].num_moves >= 3 * (days - 5)  # the ramp's bins (and the evening drop)
    # 0.09x with the default leaves of 10; leaves of 40 averaged the ramp away (0.61x)
    assert gbm[1].wape_moves < 0.3 * last[1].wape_moves
    assert gbm[1].wape <= last[1].wape


def test_wape_on_moves_counts_only_bins_that_moved():
    y = np.array([100.0, 100.0, 150.0, 150.0, 100.0, 105.0])
    fc = forecast.run_model("last", y, forecast.ForecastSpec(bin_s=BIN_S, horizon=1, min_train=2))
    s = metrics.score(y, fc, 1, [1])[0]
    assert s.num_moves == 2  # 100 -> 150 and 150 -> 100; 100 -> 105 is within 20%
    assert s.wape_moves == pytest.approx((50 + 50) / (150 + 100))
