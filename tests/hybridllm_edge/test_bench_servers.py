"""The harness of bench/edge/servers.py (our server against llama-server): what it counts
from a real streamed answer, the agentic load's shared prompt, and the table's ratios."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench(bench_module) -> ModuleType:
    return bench_module("bench/edge/servers.py")  # type: ignore[no-any-return]


def test_a_streamed_answer_is_counted_by_the_servers_usage_with_its_first_token(
    bench: ModuleType, llamacpp_server
) -> None:
    path, body = bench.request_body("plain", 0, 8)
    out = bench.stream(llamacpp_server.base_url, path, body)
    whole = bench.unstreamed(llamacpp_server.base_url, path, body)
    assert out["tokens"] == whole["tokens"] <= 8  # the usage chunk, not the events
    assert 0 < out["ttft"] < out["latency"]
    assert out["decode_tps"] > 0


def test_the_agentic_load_shares_one_system_prompt_and_varies_the_task(bench: ModuleType) -> None:
    bodies = [bench.request_body("agentic", i, 16)[1] for i in range(len(bench.TASKS) + 1)]
    systems = {b["messages"][0]["content"] for b in bodies}
    tasks = [b["messages"][1]["content"] for b in bodies]
    assert systems == {bench.SYSTEM}
    assert len(set(tasks)) == len(bench.TASKS)  # every task, then the first again
    assert tasks[-1] == tasks[0]


def test_the_table_puts_each_server_beside_llama_server(bench: ModuleType, tmp_path: Path) -> None:
    def cell(tps: float, p95: float, ttft: float | None) -> dict[str, float | None]:
        return {"tokens_per_s": tps, "p50_latency_s": p95 / 2, "p95_latency_s": p95,
                "p50_ttft_s": ttft, "p95_ttft_s": ttft}  # fmt: skip

    report = {
        "machine": {"cores": 2, "cpu": "cpu", "ram_gib": 1.0, "load": [1.0, 1.0, 1.0]},
        "load_end": [1.0, 1.0, 1.0], "command": "c", "gguf": "/m/x.gguf", "weights": "q4_1",
        "threads": 1, "max_tokens": 48, "rounds": 3, "per_client": 2,
        "servers": {"ours": "a", "llama-server": "b", "llama_cpp.server": "c"},
        "single_stream": {"ours": 45.0, "llama-server": 50.0},
        "in_process": {"streamed_decode_tps": 40.0, "unstreamed_tokens_per_s": 41.0},
        "loads": {"plain:8": {"ours": cell(60.0, 6.0, 1.0), "llama-server": cell(50.0, 8.0, 0.5),
                              "llama_cpp.server": cell(30.0, 9.0, None)}},
    }  # fmt: skip
    path = tmp_path / "out.md"
    bench.write_markdown(report, path)
    text = path.read_text()
    assert "| 45.0 | 50.0 | 0.90 | 40.0 | 41.0 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| plain | 8 |"))
    assert "| 1.20 |" in row  # 60 / 50 tok/s
    assert "| 0.75 |" in row  # p95 6 / 8
    assert "4.50 / 9.00" in row  # llama_cpp.server's p50 / p95, no TTFT
