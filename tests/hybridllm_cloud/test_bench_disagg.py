"""The harness of bench/disagg/run.py: the deployments it can run and how its report judges them.

The benchmark compares disaggregation with the best monolithic setup in the same run, so
what a deployment name runs, and which setup the report picks as the best, are tested here.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def run(bench_module: Any) -> ModuleType:
    return bench_module("bench/disagg/run.py")  # type: ignore[no-any-return]


@pytest.fixture
def report(bench_module: Any) -> ModuleType:
    return bench_module("bench/disagg/report.py")  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("monolithic", ("monolithic", None, None)),
        ("monolithic-1t", ("monolithic", 1, None)),
        ("monolithic-1t-b64", ("monolithic", 1, 64)),
        ("monolithic-b128", ("monolithic", None, 128)),
        ("two-replicas", ("two-replicas", None, None)),
        ("two-replicas-b64", ("two-replicas", None, 64)),
        ("disaggregated", ("disaggregated", None, None)),
        ("disaggregated-nocache", ("disaggregated", None, None)),
    ],
)
def test_deployment_names(run: ModuleType, name: str, parsed: tuple[Any, ...]) -> None:
    assert run.parse_deployment(name) == parsed
    assert run.describe(name, 256)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("monolithic-x", "unknown part 'x'"),
        ("two-replicas-2t", "unknown part '2t'"),  # two replicas have one thread each
        ("disaggregated-1t", "only -nocache"),
        ("hybrid", "monolithic, two-replicas or disaggregated"),
    ],
)
def test_a_bad_name_fails_before_any_run(run: ModuleType, name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        run.parse_deployment(name)


def test_describe_says_threads_and_budget(run: ModuleType) -> None:
    assert "1 torch thread, step budget 64 tokens" in run.describe("monolithic-1t-b64", 256)
    assert "2 torch threads, step budget 512 tokens (default)" in run.describe("monolithic", 256)
    assert "without prefix caching" in run.describe("disaggregated-nocache", 128)
    assert "up to 128 uncached tokens" in run.describe("disaggregated", 128)


def _median(tbt_p99: float, ttft_p99: float = 1000.0, tok_s: float = 9.0) -> dict[str, float]:
    return {"short_tbt_p50_ms": 60.0, "short_tbt_p99_ms": tbt_p99, "short_ttft_p50_ms": 150.0,
            "short_ttft_p99_ms": ttft_p99, "long_ttft_p50_s": 2.0, "long_ttft_p99_s": 3.0,
            "output_tok_s": tok_s, "errors": 0}  # fmt: skip


def test_the_report_compares_with_the_best_monolithic_setup(
    report: ModuleType, tmp_path: Path
) -> None:
    medians = {
        "monolithic": _median(900.0),
        "monolithic-1t-b64": _median(200.0),
        "disaggregated": _median(150.0, ttft_p99=100.0),
        "two-replicas": _median(120.0, tok_s=9.5),
    }
    doc = {
        "machine": "test", "command": "uv run python bench/disagg/run.py", "seconds": 60.0,
        "params": {"duration": 60, "short_rate": 0.3, "short_len": 32, "short_out": 32,
                   "long_every": 6, "long_scale": 0.5, "long_cap": 1536, "long_out": 8,
                   "repeats": 3, "threshold": 256},
        "deployments": {n: n for n in medians}, "medians": medians, "transfer": [],
    }  # fmt: skip
    pytest.importorskip("matplotlib")
    report.write_report(doc, tmp_path / "disagg")
    text = (tmp_path / "disagg.md").read_text()
    # the best monolithic setup by TBT p99 is the tuned one, not the plain engine
    assert "best monolithic setup for the interactive streams (lowest TBT p99) is `monolithic-1t-b64`" in text  # fmt: skip
    assert "interactive TBT p99 **0.75x**" in text
    # every row names its winner: two replicas on TBT p99, disaggregation on TTFT p99
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["interactive TBT p99 (ms)"].rstrip(" |").endswith("`two-replicas`")
    assert rows["interactive TTFT p99 (ms)"].rstrip(" |").endswith("`disaggregated`")
    assert rows["output tokens/s"].rstrip(" |").endswith("`two-replicas`")
    assert "Disaggregated / two replicas: TBT p99 1.25x" in text
