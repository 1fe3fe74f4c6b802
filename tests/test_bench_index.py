"""bench/index.py: the benchmark index in bench/README.md and the README's Performance table,
generated from bench/results/. Every check here reads the real results files; anything it
changes is a copy under tmp_path."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@pytest.fixture(scope="module")
def index(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("bench/index.py")


def names(module: ModuleType) -> list[str]:
    return [e.results[0] for e in module.EXPERIMENTS]


def experiment(index: ModuleType, main: str) -> Any:
    return next(e for e in index.EXPERIMENTS if e.results[0] == main)


def copy_root(tmp_path: Path, results: Path = RESULTS) -> Path:
    """The two READMEs copied, bench/results/ linked: a repository root to check and write."""
    (tmp_path / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copy(ROOT / "bench" / "README.md", tmp_path / "bench" / "README.md")
    (tmp_path / "bench" / "results").symlink_to(results)
    return tmp_path


def results_copy(tmp_path: Path, replace: dict[str, object]) -> Path:
    """bench/results/ as links to the real files, with ``replace``'s files written instead
    (a string as it is, anything else as JSON): a test never writes through a link."""
    out = tmp_path / "results"
    out.mkdir()
    for entry in RESULTS.iterdir():
        if entry.name not in replace:
            (out / entry.name).symlink_to(entry)
    for name, doc in replace.items():
        (out / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return out


def test_each_experiment_is_registered_once(index: ModuleType) -> None:
    mains = names(index)
    assert len(mains) == len(set(mains))
    assert len({e.name for e in index.EXPERIMENTS}) == len(index.EXPERIMENTS)


def test_every_registered_results_file_exists(index: ModuleType) -> None:
    r = index.Results(RESULTS)
    for e in index.EXPERIMENTS:
        if (e.pending or e.optional) and not r.exists(e.results[0]):
            continue
        missing = [name for name in e.results if not r.exists(name)]
        assert not missing, f"{e.name}: {missing} not in bench/results/"


def test_every_extractor_reads_a_headline_from_the_real_files(index: ModuleType) -> None:
    r = index.Results(RESULTS)
    read = 0
    for e in index.EXPERIMENTS:
        if not r.exists(e.results[0]):
            assert e.pending or e.optional, f"{e.name}: {e.results[0]} is missing"
            continue
        h = e.extract(r)
        assert re.search(r"\d", h.result), f"{e.name}: no number in {h.result!r}"
        assert h.met.startswith(index.VERDICTS), f"{e.name}: {h.met!r}"
        if e.goal:
            assert not h.met.startswith(index.NO_GOAL), e.name
        else:
            assert h.met == index.NO_GOAL, e.name
        read += 1
    assert read >= 20


def test_a_registered_command_runs_the_script_that_wrote_the_file(index: ModuleType) -> None:
    r = index.Results(RESULTS)
    for e in index.EXPERIMENTS:
        main = e.results[0]
        stem = main.rsplit(".", 1)[0]
        if not r.exists(f"{stem}.json"):
            continue
        doc = r.json(f"{stem}.json")
        recorded = doc.get("command") or doc.get("meta", {}).get("command")
        if not recorded:
            continue
        script = re.search(r"bench/\S+\.py", index.commands(e)[0])
        assert script is not None, e.name
        assert script.group(0) in recorded, f"{e.name}: {recorded!r}"
        assert not re.search(r"(^|\s)/(home|root|tmp|work)/", recorded), f"{main}: {recorded!r}"


def test_an_experiment_not_yet_measured_says_so(index: ModuleType, tmp_path: Path) -> None:
    r = index.Results(tmp_path)
    pending = [e for e in index.EXPERIMENTS if e.pending]
    assert pending
    for e in pending:
        h = index.headline(e, r)
        assert (h.result, h.met) == ("not yet measured", index.NOT_MEASURED)
        assert f"{e.results[0]} (not yet)" in index.links(e, r, "results/")


def test_the_readme_tables_match_the_results_files(index: ModuleType) -> None:
    assert index.main(["--check"]) == 0


def test_a_tampered_table_is_out_of_date_and_rewritten(
    index: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_root(tmp_path)
    assert index.main(["--check", "--root", str(root)]) == 0
    bench_readme, readme = root / "bench" / "README.md", root / "README.md"
    head, sep, table = bench_readme.read_text().partition(index.INDEX_START)
    bench_readme.write_text(head + sep + table.replace("0.", "9.", 1))
    capsys.readouterr()
    assert index.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "bench/README.md: the benchmark table is out of date" in err
    assert "README.md: the benchmark table" not in err.replace("bench/README.md", "")

    text = readme.read_text()
    readme.write_text(text.replace(index.PERF_END, "| a row typed by hand |\n" + index.PERF_END))
    assert index.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "bench/README.md" in err
    assert err.count("README.md: the benchmark table is out of date") == 2

    assert index.main(["--root", str(root)]) == 0
    assert index.main(["--check", "--root", str(root)]) == 0
    assert readme.read_text() == (ROOT / "README.md").read_text()
    assert bench_readme.read_text() == (ROOT / "bench" / "README.md").read_text()


def test_prose_around_the_markers_is_kept(index: ModuleType, tmp_path: Path) -> None:
    root = copy_root(tmp_path)
    readme = root / "README.md"
    readme.write_text("Before.\n\n" + readme.read_text() + "\nAfter.\n")
    assert index.main(["--root", str(root)]) == 0
    text = readme.read_text()
    assert text.startswith("Before.\n\n# hybridllm")
    assert text.endswith("\nAfter.\n")


def test_missing_markers_are_named(
    index: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_root(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace(index.PERF_START, ""))
    assert index.main(["--check", "--root", str(root)]) == 1
    assert "README.md: the markers" in capsys.readouterr().err


def test_a_results_file_without_a_number_it_needs_is_named(
    index: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads((RESULTS / "edge-servers.json").read_text())
    del doc["single_stream"]
    root = copy_root(tmp_path / "root", results_copy(tmp_path, {"edge-servers.json": doc}))
    assert index.main(["--check", "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "edge-servers.md" in err
    assert "single_stream" in err


def test_disaggregation_is_judged_against_the_best_monolithic_variant(
    index: ModuleType, tmp_path: Path
) -> None:
    """The rerun's layout: several monolithic variants and a ``deployments`` key."""
    doc = json.loads((RESULTS / "disagg.json").read_text())
    med = doc["medians"]
    dis_tbt = med["disaggregated"]["short_tbt_p99_ms"]
    variants = {"monolithic-1t": 1.5, "monolithic-1t-b128": 0.9 / 0.5, "monolithic-1t-b64": 3.0}
    for name, over in variants.items():
        med[name] = dict(med["monolithic"], short_tbt_p99_ms=dis_tbt * over)
    med["monolithic"]["short_tbt_p99_ms"] = dis_tbt * 4
    doc["deployments"] = {name: "..." for name in med}
    r = index.Results(results_copy(tmp_path, {"disagg.json": doc}))
    h = experiment(index, "disagg.md").extract(r)
    assert "0.67x the best monolithic setup's (`monolithic-1t`" in h.result
    assert h.met == index.NOT_MET
    assert "`monolithic-1t-b64`" in h.peer_note

    doc = json.loads((RESULTS / "disagg.json").read_text())
    h = experiment(index, "disagg.md").extract(index.Results(RESULTS))
    best = min(
        (n for n in doc["medians"] if n.startswith("monolithic")),
        key=lambda n: doc["medians"][n]["short_tbt_p99_ms"],
    )
    assert f"(`{best}`:" in h.result


def test_the_non_streaming_gateway_layout_is_read(index: ModuleType, tmp_path: Path) -> None:
    doc = json.loads((RESULTS / "gateway.json").read_text())
    doc["args"]["no_stream"] = True
    md = "# Gateway benchmark: non-streaming requests\n"
    r = index.Results(results_copy(tmp_path, {"gateway-nonstream.json": doc, "gateway-nonstream.md": md}))  # fmt: skip
    h = experiment(index, "gateway-nonstream.md").extract(r)
    assert "p99 added end to end at 256 requests in flight" in h.result
    assert "throughput over LiteLLM's" in h.result
    assert h.met.startswith((index.MET, index.NOT_MET))
