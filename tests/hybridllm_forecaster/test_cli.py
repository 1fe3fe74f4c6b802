from __future__ import annotations

import json

import pytest

from hybridllm_forecaster import cli

from .conftest import run_cli as run


@pytest.mark.slow
def test_eval_on_an_unseen_trace_writes_report_and_plots(tmp_path, traces, capsys):
    stream = traces.ramp_stream(duration_s=5400.0, low=0.5, high=4.0, seed=3)
    path = traces.azure_csv(tmp_path / "never-seen.csv", stream)
    out = tmp_path / "out"
    assert (
        run(["forecast", "eval", "--trace", str(path), "--out", str(out), "--slo", "ttft=3"]) == 0
    )
    data = json.loads((out / "results.json").read_text())
    policies = {row["policy"] for row in data["policies"]}
    assert policies == {
        "hpa",
        "hpa-tuned",
        "keda-queue",
        "predictive",
        "predictive+floor",
        "oracle",
    }
    assert all(0.0 <= row["slo_attainment"] <= 1.0 for row in data["policies"])
    assert {row["model"].rstrip(" *") for row in data["forecasts"]} >= {"last", "gbm"}
    for name in ("timeline.png", "timeline_zoom.png", "frontier.png", "forecast_errors.png"):
        assert (out / name).stat().st_size > 10_000
    assert "TTFT 3 s" in (out / "report.md").read_text()
    assert "Policies on the test period" in capsys.readouterr().out


def test_eval_reports_malformed_input_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n')
    assert run(["forecast", "eval", "--trace", str(path)]) == 2
    assert f"{path}:2:" in capsys.readouterr().err


def test_slo_parsing():
    assert cli.parse_slo("1.5").ttft_s == 1.5
    assert cli.parse_slo("ttft=1,tbt=0.05").tbt_s == 0.05
    with pytest.raises(ValueError, match="unknown keys"):
        cli.parse_slo("p99=1")
