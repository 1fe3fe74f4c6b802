"""The gateway benchmark's load generator, against real servers: what it reports is true.

It reads answers itself (kernel receive timestamps), so its parsing and clocks are tested
here: streams counted once and whole, the wire clock never after the app clock, stream
length matching the backend's rate, errors counted with their cause, keep-alive reused.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def lg(bench_module: Any) -> ModuleType:
    return bench_module("bench/gateway/loadgen.py")  # type: ignore[no-any-return]


def test_counts_whole_streams_on_both_clocks(procs: Any, lg: ModuleType) -> None:
    tokens, rate = 5, 50.0
    backend = procs.tokenserver("b", "--rate", str(rate))
    out = asyncio.run(lg.load(backend.url, 4, 1.0, tokens, rate, timeout_s=10.0))
    assert out["errors"] == 0, out["first_errors"]
    assert out["completed"] >= 4
    # every stream is (tokens - 1) intervals long on the wire and in the app
    for key in ("e2e_p50", "app_e2e_p50"):
        assert (tokens - 1) / rate * 0.9 <= out[key] < (tokens - 1) / rate + 0.5, out
    # the kernel saw the bytes no later than this process read them
    for q in ("ttft_p50", "ttft_p99", "e2e_p99"):
        assert 0 < out[q] <= out[f"app_{q}"] + 1e-4, (q, out)
    stats = backend.stats()
    # one request per worker is still in its window when it ends: all were answered whole
    assert stats["completed"] == stats["requests"] >= out["completed"]


def test_through_the_gateway_with_its_key(
    procs: Any, table: Callable[..., dict[str, Any]], lg: ModuleType
) -> None:
    backend = procs.tokenserver("b")
    keys = procs.tmp / "keys"
    keys.write_text(f"bench:{hashlib.sha256(lg.KEY.encode()).hexdigest()}\n")
    gw = procs.gateway(table(cloud=[backend.url], policy="cloud-only"),
                       "--api-keys-file", str(keys))  # fmt: skip
    out = asyncio.run(lg.load(gw.url, 3, 0.5, 3, 50.0, timeout_s=10.0))
    assert out["errors"] == 0, out["first_errors"]
    assert out["completed"] >= 3


def test_errors_are_counted_with_their_cause(procs: Any, lg: ModuleType) -> None:
    backend = procs.tokenserver("b", "--fail-status", "503")
    out = asyncio.run(lg.load(backend.url, 2, 0.5, 3, 50.0, timeout_s=10.0))
    assert out["completed"] == 0
    assert out["errors"] > 0
    assert any("HTTP 503" in e for e in out["first_errors"]), out["first_errors"]


def test_non_streaming_answers_are_read_whole(procs: Any, lg: ModuleType) -> None:
    tokens, rate = 5, 50.0
    backend = procs.tokenserver("b", "--rate", str(rate))
    out = asyncio.run(lg.load(backend.url, 3, 1.0, tokens, rate, timeout_s=10.0, stream=False))
    assert out["errors"] == 0, out["first_errors"]
    assert out["completed"] >= 3
    # a plain answer comes after the whole generation, in one piece: first byte ~ last byte
    assert out["ttft_p50"] >= (tokens - 1) / rate * 0.9, out
    assert out["e2e_p50"] - out["ttft_p50"] < 0.05, out
    stats = backend.stats()
    assert stats["completed"] == stats["requests"] >= out["completed"]
