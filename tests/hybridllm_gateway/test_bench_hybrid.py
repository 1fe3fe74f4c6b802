"""The harness of bench/hybrid/ (the hybrid claim): sessions, their replay, cost, manifests.

The replay goes through a real gateway to a real token server with the ``openai``
client, as the benchmark does: a session's calls arrive in order, each after the previous
answer and its tool wait, and carry the history the trajectory had before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .conftest import MODEL

TRAJ = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "swe-agent"
needs_traces = pytest.mark.skipif(not TRAJ.exists(), reason="shared traces not present")


@pytest.fixture
def sessions(bench_module: Any) -> ModuleType:
    return bench_module("bench/hybrid/sessions.py")  # type: ignore[no-any-return]


@pytest.fixture
def hybrid(bench_module: Any) -> ModuleType:
    return bench_module("bench/hybrid/run.py")  # type: ignore[no-any-return]


@needs_traces
def test_a_trajectory_becomes_calls_with_the_history_before_each(sessions: ModuleType) -> None:
    path = TRAJ / "ctf__rev__rock.traj"
    history = [m for m in json.loads(path.read_text())["history"] if m["role"] != "tool"]
    answers = sum(m["role"] == "assistant" for m in history)
    scale = sessions.Scale(system_chars=500, message_chars=80, max_tokens=16, max_calls=50)
    s = sessions.load_trajectory(path, scale)
    assert len(s.calls) == answers
    first = s.calls[0].messages
    assert first[0]["role"] == "system"
    assert len(first[0]["content"]) == 500
    for prev, nxt in zip(s.calls, s.calls[1:], strict=False):
        # the context only grows: each call repeats the one before, then its answer and
        # the tool's output, in the trajectory's order
        assert nxt.messages[: len(prev.messages)] == prev.messages
        assert nxt.messages[len(prev.messages)]["role"] == "assistant"
        assert len(nxt.messages) > len(prev.messages)
    assert all(len(m["content"]) <= 80 for c in s.calls for m in c.messages[1:])
    assert all(c.max_tokens == 16 for c in s.calls)
    assert sessions.load_trajectory(path, sessions.Scale(max_calls=3)).calls == [
        sessions.load_trajectory(path, sessions.Scale(max_calls=50)).calls[i] for i in range(3)
    ]


@needs_traces
def test_tool_waits_come_from_the_trajectory(sessions: ModuleType) -> None:
    timed = next(p for p in sorted(TRAJ.glob("*.traj"))
                 if any("execution_time" in st for st in json.loads(p.read_text()).get("trajectory", [])))  # fmt: skip
    steps = json.loads(timed.read_text())["trajectory"]
    s = sessions.load_trajectory(timed, sessions.Scale(max_calls=50, tool_wait_factor=2.0))
    for call, step in zip(s.calls, steps, strict=False):
        assert call.tool_wait_s == pytest.approx(2.0 * (step["execution_time"] or 0.3))
    untimed = sessions.load_trajectory(TRAJ / "ctf__rev__rock.traj", sessions.Scale())
    assert {c.tool_wait_s for c in untimed.calls} == {0.3}


@needs_traces
def test_every_trajectory_loads(sessions: ModuleType) -> None:
    loaded = sessions.load_sessions(sessions.Scale())
    assert len(loaded) >= 15
    assert all(2 <= len(s.calls) <= 12 for s in loaded)


def test_replay_keeps_turn_order_and_tool_waits(
    procs: Any, table: Callable[..., dict[str, Any]], sessions: ModuleType, hybrid: ModuleType
) -> None:
    backend = procs.tokenserver("b", "--echo")
    gw = procs.gateway(table(cloud=[backend.url], policy="cloud-only"))
    waits = [0.2, 0.4, 0.1]
    calls = [sessions.Call([{"role": "user", "content": f"turn {i}"}], 4, w)
             for i, w in enumerate(waits)]  # fmt: skip
    session = sessions.Session("s", calls)
    _, send = hybrid.make_send(gw.url + "/v1", model=MODEL)
    results, wall = asyncio.run(sessions.replay([session, session], send, concurrency=2))
    assert len(results) == 2
    for r in results:
        assert [c.index for c in r.calls] == [0, 1, 2]
        assert not any(c.error for c in r.calls), [c.error for c in r.calls]
        # the echo server answers with the prompt it got: each call carried its own turn
        assert [f"turn {i}" in c.text for i, c in enumerate(r.calls)] == [True] * 3
        assert {c.tier for c in r.calls} == {"cloud"}
        for prev, nxt, wait in zip(r.calls, r.calls[1:], waits, strict=False):
            assert nxt.sent >= prev.sent + prev.latency_s + wait
    assert wall >= sum(waits[:-1])
    assert backend.stats()["requests"] == 6


def test_a_failed_call_fails_only_itself(sessions: ModuleType) -> None:
    async def send(messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int, int, str, str]:  # fmt: skip
        if messages[0]["content"] == "bad":
            raise ValueError("boom")
        return "ok", 3, 1, "edge", "classifier"

    calls = [sessions.Call([{"role": "user", "content": c}], 1, 0.0) for c in ("a", "bad", "b")]
    [r], _ = asyncio.run(sessions.replay([sessions.Session("s", calls)], send, 1))
    assert [c.error.startswith("ValueError") for c in r.calls] == [False, True, False]
    assert [c.text for c in r.calls] == ["ok", "", "ok"]


def test_cost_arithmetic(bench_module: Any) -> None:
    cost = bench_module("bench/hybrid/cost.py")
    # one core for an hour at $0.05 serving a million tokens: $0.05 per million
    assert cost.cpu_cost_per_million(3600, 1_000_000, 0.05) == pytest.approx(0.05)
    assert cost.cpu_cost_per_million(1800, 250_000, 0.05) == pytest.approx(0.10)
    assert cost.per_million(1.0, 0) == float("inf")
    with pytest.raises(ValueError, match="non-negative"):
        cost.per_million(-1.0, 10)
    pools = [cost.Pool("prefill", 2, 2.0), cost.Pool("decode", 1, 1.0)]
    assert cost.cluster_cost_per_million(pools, 1_000_000) == pytest.approx(5.0)
    assert cost.cluster_cost_per_million(pools, 2_500_000) == pytest.approx(2.0)


def test_agreement_counts_identical_answers(sessions: ModuleType, hybrid: ModuleType) -> None:
    def result(texts: list[str], tiers: list[str]) -> Any:
        r = sessions.SessionResult("s")
        r.calls = [sessions.CallResult("s", i, 0.0, 0.1, 1, 1, tier, "", t)
                   for i, (t, tier) in enumerate(zip(texts, tiers, strict=True))]  # fmt: skip
        return r

    a = result(["x", "y", "z", "w"], ["edge", "edge", "cloud", "cloud"])
    b = result(["x", "n", "z", "m"], ["cloud"] * 4)
    got = hybrid.agreement([a], [b])
    assert got == {"calls": 4, "identical": 0.5, "identical_edge_calls": 0.5, "edge_calls": 2}


@pytest.mark.parametrize("arch", ["monolithic", "disaggregated", "hybrid", "hybrid-edge-first"])
def test_manifests_are_valid_services_on_two_cores(
    arch: str, hybrid: ModuleType, tmp_path: Path
) -> None:
    import yaml

    from hybridllm_operator.local import plan as plan_mod

    args = argparse.Namespace(context_length=2048, edge_quantization="q4_k_m",
                              edge_max_prompt_tokens=1024, cascade_min_mean_logprob=-1.5)  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(hybrid.manifest(arch, args)))
    service = plan_mod.load_manifest(path)  # the operator's validation: raises on any error
    spec = hybrid.manifest(arch, args)["spec"]
    cores = (
        int(spec["edge"]["pool"]["resources"]["cpu"]) if spec["edge"].get("enabled", True) else 0
    )
    cloud = spec["cloud"]
    pools = ["monolithic"] if cloud["mode"] == "monolithic" else ["prefill", "decode"]
    cores += sum(int(cloud[k]["resources"]["cpu"]) * cloud[k]["replicas"] for k in pools)
    assert cores == 2
    assert service is not None
    with pytest.raises(ValueError, match="one of"):
        hybrid.manifest("bogus", args)
