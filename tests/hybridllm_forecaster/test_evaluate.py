from __future__ import annotations

from hybridllm_forecaster import evaluate
from hybridllm_forecaster.simresult import SimResult


def run(slo: float, hours: float) -> SimResult:
    return SimResult("p", "fluid", 100.0, slo, slo, 1.0, hours, 3600.0)


def test_window_choice_takes_the_cheapest_sweep_reaching_the_reference():
    options = {
        0.0: [(0.7, run(0.95, 12.0)), (0.8, run(0.90, 10.0))],
        300.0: [(0.7, run(0.97, 13.0)), (0.8, run(0.93, 11.0))],
    }
    assert evaluate._choose_window(options, 0.92) == 300.0  # 11 h vs 12 h
    assert evaluate._choose_window(options, 0.90) == 0.0  # 10 h vs 11 h
    assert evaluate._choose_window(options, 0.99) == 300.0  # neither: the best attainment


def test_settings_chosen_on_training_reach_the_reference_most_cheaply():
    train = {
        "hpa": [(0.6, run(0.96, 14.0)), (0.7, run(0.92, 12.0))],
        "predictive": [(0.7, run(0.95, 12.5)), (0.75, run(0.93, 11.5)), (0.8, run(0.88, 10.0))],
    }
    assert evaluate._choose_settings(train) == {"hpa": 0.7, "predictive": 0.75}
