from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from hybridllm_forecaster import loaders
from hybridllm_forecaster.errors import TraceFormatError

SHARED = Path(os.environ["HYBRIDLLM_TRACES"])


def test_azure_csv_roundtrip(tmp_path, traces, small_stream):
    path = traces.azure_csv(tmp_path / "a.csv", small_stream)
    assert loaders.detect_format(path) == "requests-csv"
    got = loaders.load_requests(path)
    assert got.num_requests == small_stream.num_requests
    np.testing.assert_allclose(
        got.arrival_s, small_stream.arrival_s - small_stream.arrival_s[0], atol=1e-5
    )
    np.testing.assert_array_equal(got.input_tokens, small_stream.input_tokens)
    assert got.start_epoch_s is not None


def test_csv_columns_found_by_name_and_numeric_ms_times(tmp_path):
    path = tmp_path / "burst.csv"
    path.write_text("Model,timestamp_ms,Request tokens,Response tokens\nx,2000,10,5\nx,1000,20,6\n")
    got = loaders.load_requests(path)
    np.testing.assert_allclose(got.arrival_s, [0.0, 1.0])
    np.testing.assert_array_equal(got.input_tokens, [20, 10])  # sorted by arrival


def test_mooncake_keeps_prefix_ids(tmp_path, traces, small_stream):
    path = traces.mooncake(tmp_path / "m.jsonl", small_stream)
    assert loaders.detect_format(path) == "mooncake"
    got = loaders.load_requests(path)
    assert got.num_requests == small_stream.num_requests
    assert got.prefix_ids is not None
    assert got.prefix_ids[3] == [0, 4]


def test_servegen_folder_sums_clients_and_keeps_rates_exact(tmp_path, traces):
    folder = tmp_path / "sg"
    folder.mkdir()
    traces.servegen_client(folder / "chunk-1-trace.csv", np.array([1.0, 2.0, 0.0, 4.0]))
    traces.servegen_client(folder / "chunk-2-trace.csv", np.array([0.5, 0.5, 0.5, 0.5]), cv=2.0)
    (folder / "LICENSE").write_text("Apache")
    assert loaders.detect_format(folder) == "servegen"
    demand, stream = loaders.load_demand(folder)
    assert stream is None
    assert demand.bin_s == 600
    np.testing.assert_allclose(demand.req_per_s, [1.5, 2.5, 0.5, 4.5])
    assert demand.cv()[2] == pytest.approx(2.0)  # only the bursty client is active
    sampled = loaders.load_requests(folder)
    assert sampled.num_requests == pytest.approx(9.0 * 600, rel=0.1)


def test_servegen_folder_as_upstream_ships_it(tmp_path, traces, caplog):
    """ServeGen's repository keeps a ``chunk-N-dataset.json`` (per-client length
    distributions) beside each ``chunk-N-trace.csv``: the traces are read, the rest is
    skipped with a note that names it."""
    folder = tmp_path / "data" / "language" / "m-large"
    folder.mkdir(parents=True)
    traces.servegen_client(folder / "chunk-1-trace.csv", np.array([1.0, 2.0, 3.0]))
    traces.servegen_client(folder / "chunk-2-trace.csv", np.array([1.0, 1.0, 1.0]))
    for n in (1, 2):
        (folder / f"chunk-{n}-dataset.json").write_text(
            '{"0": {"input_tokens": {"mean": 1024}, "output_tokens": {"mean": 256}}}'
        )
    with caplog.at_level("WARNING", logger="hybridllm_forecaster.loaders"):
        assert loaders.detect_format(tmp_path / "data") == "servegen"
        demand, _ = loaders.load_demand(tmp_path / "data")
    np.testing.assert_allclose(demand.req_per_s, [2.0, 3.0, 4.0])
    assert "skipped 2 file(s) that are not traces" in caplog.text
    assert "chunk-1-dataset.json" in caplog.text


def test_a_folder_of_csv_traces_skips_metadata_beside_them(tmp_path, traces, small_stream, caplog):
    folder = tmp_path / "azure"
    folder.mkdir()
    traces.azure_csv(folder / "trace.csv", small_stream)
    (folder / "schema.json").write_text('{"columns": ["TIMESTAMP"]}')
    with caplog.at_level("WARNING", logger="hybridllm_forecaster.loaders"):
        stream = loaders.load_requests(folder)
    assert stream.num_requests == small_stream.num_requests
    assert "schema.json" in caplog.text


def test_a_folder_without_any_trace_is_still_an_error(tmp_path):
    folder = tmp_path / "meta"
    folder.mkdir()
    (folder / "chunk-1-dataset.json").write_text('{"0": {}}')
    with pytest.raises(TraceFormatError, match="no trace files"):
        loaders.detect_format(folder)


def test_servegen_aggregate_file(tmp_path):
    path = tmp_path / "agg.csv"
    path.write_text("t_sec,req_per_min\n0,60\n600,120\n")
    demand, _ = loaders.load_demand(path)
    np.testing.assert_allclose(demand.req_per_s, [1.0, 2.0])


def test_swe_agent_sessions(tmp_path, traces):
    folder = tmp_path / "traj"
    folder.mkdir()
    traces.trajectory(folder / "a.traj", num_calls=3)
    traces.trajectory(folder / "b.traj", num_calls=5)
    assert loaders.detect_format(folder) == "swe-agent"
    stream = loaders.load_requests(folder)
    assert stream.session_ids is not None
    for sid in np.unique(stream.session_ids)[:20]:
        calls = stream.input_tokens[stream.session_ids == sid]
        assert len(calls) in (3, 5)
        assert np.all(np.diff(calls) > 0)  # each call's prompt holds the history before it


@pytest.mark.parametrize(
    ("name", "content", "line", "needle"),
    [
        ("bad_tokens.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,5,1\n"
         "2024-01-01 00:00:01,5,1\n2024-01-01 00:00:02,five,1\n", 4, "ContextTokens"),
        ("bad_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,5,1\n"
         "yesterday,5,1\n", 3, "TIMESTAMP"),
        ("neg.csv", "timestamp,input_tokens,output_tokens\n0,5,1\n1,5,-3\n", 3, "output_tokens"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
         '{"timestamp": 5, "input_length": 1, "output_length": 1}\n'
         '{"timestamp": 9, "input_', 3, "JSON"),
        ("missing.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
         '{"timestamp": 5, "input_length": 1}\n', 2, "output_length"),
        ("sg.csv", "0,1.0,1.0,Gamma,1.0,1.0\n600,fast,1.0,Gamma,1.0,1.0\n", 2, "column 2"),
        ("empty.csv", "\n\n", 1, "empty"),
        ("what.csv", "a,b,c\n1,2,3\n", 1, "unrecognised"),
    ],
)  # fmt: skip
def test_malformed_input_names_file_and_line(tmp_path, name, content, line, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceFormatError) as info:
        loaders.load_requests(path)
    assert info.value.line == line
    assert str(info.value).startswith(f"{path}:{line}:")
    assert needle in str(info.value)


def test_trajectory_without_history(tmp_path):
    path = tmp_path / "x.traj"
    path.write_text('{"trajectory": [], "history": "nope"}')
    with pytest.raises(TraceFormatError, match="history"):
        loaders.load_requests(path)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        loaders.load_requests(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="unknown trace format"):
        loaders.load_requests(tmp_path, fmt="parquet")


@pytest.mark.parametrize(
    ("rel", "fmt"),
    [
        pytest.param(rel, fmt, marks=pytest.mark.dev_traces(rel))
        for rel, fmt in [
            ("azure-2023/AzureLLMInferenceTrace_code.csv", "requests-csv"),
            ("mooncake-2025/conversation_trace.jsonl", "mooncake"),
            ("servegen-2025/m-large/chunk-78-trace.csv", "servegen"),
            ("servegen-2025/m-large-aggregate-10min.csv", "servegen"),
            ("swe-agent", "swe-agent"),
        ]
    ],
)
def test_detects_the_shipped_traces(rel, fmt):
    assert loaders.detect_format(SHARED / rel) == fmt


def test_a_trace_split_by_time_into_files_is_joined_not_overlaid(tmp_path, traces, small_stream):
    """Issue #56 (1): a trace split by time across files (as public traces are shipped) was
    read as the files overlaid, half the length at twice the rate. Each file keeps its own
    clock now: consecutive parts are joined, files that overlap in time (one per server)
    merged, and the report's header says which."""
    whole = traces.mooncake(tmp_path / "whole.jsonl", small_stream)
    lines = whole.read_text().splitlines(keepends=True)
    folder = tmp_path / "split"
    folder.mkdir()
    half = len(lines) // 2
    (folder / "part-1.jsonl").write_text("".join(lines[:half]))
    (folder / "part-2.jsonl").write_text("".join(lines[half:]))
    one, parts = loaders.load_requests(whole), loaders.load_requests(folder)
    assert parts.num_requests == one.num_requests
    assert parts.duration_s == pytest.approx(one.duration_s)
    np.testing.assert_allclose(parts.arrival_s, one.arrival_s)
    assert parts.notes == [f"2 files of {folder} joined by time (consecutive parts, one clock)"]
    a, _ = loaders.load_demand(whole, bin_s=60.0)
    b, _ = loaders.load_demand(folder, bin_s=60.0)
    np.testing.assert_allclose(a.req_per_s, b.req_per_s)
    # two servers over the same hours whose clocks both start at zero cannot be told from
    # parts that restart: auto joins them (and says how to merge), --files merge merges
    servers = tmp_path / "servers"
    servers.mkdir()
    traces.mooncake(servers / "a.jsonl", small_stream)
    traces.mooncake(servers / "b.jsonl", small_stream)
    assert "clocks restart at zero" in loaders.load_requests(servers).notes[0]
    both = loaders.load_requests(servers, files="merge")
    assert both.num_requests == 2 * one.num_requests
    assert both.duration_s == pytest.approx(one.duration_s)
    assert "merged by arrival time on their own clocks (--files merge)" in both.notes[0]


def test_recording_gaps_in_a_rate_trace_are_bridged_and_reported(tmp_path, traces):
    """Issue #56 (2): a window where every client drops to zero between two normal ones,
    or a window missing from every file, is a hole in the recording, replayed before as
    demand falling to nothing. It is bridged from its neighbours and counted in the notes;
    a long run at zero (a quiet night) and a zero beside quiet windows stay real."""
    folder = tmp_path / "sg"
    folder.mkdir()
    a = np.array([4.0, 4.0, 0.0, 4.0, 4.0, 0.0, 0.0, 0.0, 4.0, 0.1, 0.0, 0.1, 4.0, 4.0])
    traces.servegen_client(folder / "chunk-1-trace.csv", a)
    traces.servegen_client(folder / "chunk-2-trace.csv", a / 2)
    lines = (folder / "chunk-2-trace.csv").read_text().splitlines(keepends=True)
    # window 13 is missing from both files; so is nothing else
    (folder / "chunk-2-trace.csv").write_text("".join(lines[:13]))
    c1 = (folder / "chunk-1-trace.csv").read_text().splitlines(keepends=True)
    (folder / "chunk-1-trace.csv").write_text("".join(c1[:13]) + c1[13].replace("7800", "8400"))
    demand, _ = loaders.load_demand(folder)
    rates = demand.req_per_s
    assert rates[2] == pytest.approx(6.0)  # one window at zero between normal ones: a gap
    np.testing.assert_allclose(rates[5:8], 0.0)  # three in a row: real
    assert rates[10] == 0.0  # beside quiet windows: real
    assert rates[13] == pytest.approx(5.0)  # missing: bridged between 6 and 4
    assert demand.notes == [
        "2 recording gap window(s) bridged from their neighbours (1 missing, 1 with every "
        "client at zero, each between windows of normal demand; at most 2 in a row)"
    ]
    stream = loaders.load_requests(folder)
    assert demand.notes[0] in stream.notes
