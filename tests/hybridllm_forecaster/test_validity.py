"""`forecast eval` on traces it has never seen: a comparison whose validity checks pass,
or a loud refusal (no verdict, exit status 3), never a verdict from a saturated, idle,
out-of-reach or empty comparison. The traces are the shared development traces
transformed (scaled 10x and 100x, long prompts only, bursty, flat), so the checks are
exercised on shapes the development traces do not have."""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from hybridllm_forecaster import loaders, report
from hybridllm_forecaster.stream import RequestStream

from .conftest import run_cli as run

TRACES = Path(os.environ["HYBRIDLLM_TRACES"])
CONV = TRACES / "azure-2023" / "AzureLLMInferenceTrace_conv.csv"


def test_a_finding_within_the_noise_is_no_difference() -> None:
    assert report.finding(0.4, 1.0) == "no difference"  # the 0.4-point "goal met"
    assert report.finding(-1.9, 1.02) == "no difference"
    assert report.finding(2.5, 0.99) == "better"
    assert report.finding(0.0, 0.9) == "better"
    assert report.finding(-3.0, 1.1) == "worse"
    assert report.finding(3.0, 1.1) == "mixed"
    assert report.finding(math.nan, math.nan) == "no difference"


@functools.cache  # read once for every case below (a few seconds each time)
def _conv() -> RequestStream:
    _, stream = loaders.load_demand(CONV, loaders.detect_format(CONV))
    assert stream is not None
    return stream


def _transform(stream: RequestStream, how: str, seed: int = 0) -> RequestStream:
    """The conv trace reshaped: ``x10``/``x100`` (each request repeated with jittered
    arrivals), ``long`` (prompts of 15k tokens on average, the long-prompt trace's),
    ``bursty`` (arrivals bunched into 20 s bursts), ``flat`` (arrivals spread evenly)."""
    rng = np.random.default_rng(seed)
    t, i, o = stream.arrival_s, stream.input_tokens, stream.output_tokens
    if how in ("x10", "x100"):
        k = int(how[1:])
        t = np.concatenate([t + rng.uniform(0, 1.0, len(t)) for _ in range(k)])
        i, o = np.tile(i, k), np.tile(o, k)
    elif how == "long":
        i = np.maximum(1, rng.lognormal(np.log(12_000), 0.7, len(i))).astype(int)
    elif how == "bursty":
        t = np.floor(t / 600.0) * 600.0 + rng.uniform(0, 20.0, len(t))
    elif how == "flat":
        t = np.linspace(t.min(), t.max(), len(t))
    order = np.argsort(t, kind="stable")
    return RequestStream(t[order], np.asarray(i)[order], np.asarray(o)[order], source=how)


@pytest.mark.slow
@pytest.mark.dev_traces("azure-2023/AzureLLMInferenceTrace_conv.csv")
@pytest.mark.parametrize(
    ("how", "extra"),
    [
        ("x10", []), ("x100", []), ("x100", ["--max-replicas", "20"]), ("long", []),
        ("bursty", []), ("flat", []), ("flat", ["--capacity-scale", "40"]),
        ("x100", ["--demand-scale", "auto"]), ("long", ["--demand-scale", "auto"]),
    ],
)  # fmt: skip
def test_a_transformed_trace_gives_a_valid_comparison_or_a_loud_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], traces, how: str, extra: list[str]
) -> None:
    path = traces.azure_csv(tmp_path / f"conv-{how}.csv", _transform(_conv(), how))
    out = tmp_path / "out"
    code = run(["forecast", "eval", "--trace", str(path), "--out", str(out), "--model", "last",
                "--simulator", "fluid", *extra])  # fmt: skip
    data = json.loads((out / "results.json").read_text())
    validity, verdict = data["validity"], data["verdict"]
    printed = capsys.readouterr().out
    assert "Validity checks" in printed
    assert "## Validity checks" in (out / "report.md").read_text()
    saturated = max(validity["time_at_max"].values()) > report.SATURATED_SHARE
    idle = min(validity["time_at_min"].values()) > report.FLOOR_SHARE
    # out of reach: no setting of any policy, nor a fixed pool, meets it (not the oracle's
    # cheapest setting alone)
    unreachable = validity["best_attainment"] < report.UNREACHABLE_ATTAINMENT
    if code == report.EXIT_NOT_MEANINGFUL:
        assert validity["meaningful"] is False
        assert validity["problems"]
        assert verdict["comparison_meaningful"] is False
        for fam in ("predictive", "predictive+floor", "oracle"):
            assert verdict[fam]["goal_met"] is None
            assert verdict[fam]["finding"] is None
        assert "No verdict" in printed
    else:
        assert code == 0
        assert validity["meaningful"] is True
        # a verdict only where nothing voids it
        assert not saturated
        assert not idle
        assert not unreachable
        for fam in ("predictive", "predictive+floor", "oracle"):
            assert verdict[fam]["finding"] in ("better", "worse", "mixed", "no difference")
            assert isinstance(verdict[fam]["goal_met"], bool)
    # the checks that void it are the ones measured
    assert saturated == any("maximum" in p for p in validity["problems"])
    assert idle == any("minimum" in p for p in validity["problems"])
    assert unreachable == any("out of reach" in p for p in validity["problems"])
    if (how, extra) in (("flat", []), ("x100", ["--demand-scale", "auto"])):
        # these are comparisons one can read (the 100x trace once sized to the pool)
        assert code == 0, validity["problems"]
    if extra[:1] == ["--max-replicas"]:
        assert code == report.EXIT_NOT_MEANINGFUL
        assert saturated
    if how == "long":
        share = validity["unattainable_share"]
        assert share is not None
        assert share > 0.05
    if extra == ["--capacity-scale", "40"]:
        assert code == report.EXIT_NOT_MEANINGFUL
        assert idle


def test_a_test_period_without_traffic_is_refused(tmp_path: Path, traces) -> None:
    rng = np.random.default_rng(1)
    t = np.sort(rng.uniform(0, 3000.0, 3000))  # every request in the first 50 minutes
    t = np.concatenate([t, [6000.0]])  # and one at the end: the test half is empty
    stream = RequestStream(t, np.full(len(t), 800), np.full(len(t), 100), source="empty")
    path = traces.azure_csv(tmp_path / "empty-test.csv", stream)
    out = tmp_path / "out"
    code = run(["forecast", "eval", "--trace", str(path), "--out", str(out), "--model", "last",
                "--simulator", "fluid", "--bin-s", "60"])  # fmt: skip
    assert code == report.EXIT_NOT_MEANINGFUL
    problems = json.loads((out / "results.json").read_text())["validity"]["problems"]
    assert any("1 requests (fewer than 100): too few" in p for p in problems), problems


def test_demand_scaling_keeps_request_sizes_and_the_rates_shape(traces) -> None:
    stream = traces.ramp_stream(duration_s=7200.0, low=1.0, high=8.0, seed=2)
    base = stream.to_demand(300.0)
    for factor in (0.1, 0.5, 3.0, 12.5):
        scaled = stream.scaled(factor, seed=4)
        assert scaled.num_requests == pytest.approx(factor * stream.num_requests, rel=0.08)
        assert np.all(np.diff(scaled.arrival_s) >= 0)
        # sizes are drawn from the trace's own
        assert set(np.unique(scaled.input_tokens)) <= set(np.unique(stream.input_tokens))
        assert scaled.input_tokens.mean() == pytest.approx(stream.input_tokens.mean(), rel=0.1)
        rate = scaled.to_demand(300.0).req_per_s[: base.num_bins]
        assert np.corrcoef(rate, base.req_per_s[: len(rate)])[0, 1] > 0.8
    rates = base.scaled(0.25)
    assert np.allclose(rates.req_per_s, base.req_per_s / 4)
    assert np.allclose(rates.input_tok_per_s, base.input_tok_per_s / 4)
    with pytest.raises(ValueError, match="must be positive"):
        stream.scaled(0.0)


def test_the_old_capacity_auto_is_refused_with_its_replacement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], traces
) -> None:
    path = traces.azure_csv(tmp_path / "t.csv", traces.ramp_stream(duration_s=1800.0))
    assert run(["forecast", "eval", "--trace", str(path), "--capacity-scale", "auto"]) == 2
    assert "--demand-scale auto" in capsys.readouterr().err
    assert run(["forecast", "eval", "--trace", str(path), "--demand-scale", "-1"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert run(["forecast", "eval", "--trace", str(path), "--max-replicas", "0"]) == 2
    assert "need 1 <= min <= max" in capsys.readouterr().err
