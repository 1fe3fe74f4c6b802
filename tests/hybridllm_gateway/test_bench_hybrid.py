"""The harness of bench/hybrid/ (the hybrid claim): sessions, their replay, cost, manifests.

The replay goes through a real gateway to a real token server with the ``openai``
client, as the benchmark does: a session's calls arrive in order, each after the previous
answer and its tool wait, and carry the history the trajectory had before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .conftest import MODEL

TRAJ = Path(os.environ["HYBRIDLLM_TRACES"]) / "swe-agent"
needs_traces = pytest.mark.dev_traces("swe-agent")


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


def test_a_built_call_gets_the_answers_its_session_got_before_it(
    procs: Any, table: Callable[..., dict[str, Any]], sessions: ModuleType, hybrid: ModuleType
) -> None:
    backend = procs.tokenserver("b", "--echo")
    gw = procs.gateway(table(cloud=[backend.url], policy="cloud-only"))
    given: list[list[str]] = []

    def build(k: int) -> Any:
        def messages(answers: list[str]) -> list[dict[str, str]]:
            given.append(answers)
            return [{"role": "user", "content": f"call {k} after {len(answers)} answers"}]

        return messages

    calls = [sessions.Call([], 4, 0.0, build=build(k)) for k in range(3)]
    _, send = hybrid.make_send(gw.url + "/v1", model=MODEL)
    [r], _ = asyncio.run(sessions.replay([sessions.Session("w", calls)], send, concurrency=1))
    assert not any(c.error for c in r.calls), [c.error for c in r.calls]
    # each call was built from the real answers before it (the echo of the earlier prompts)
    assert [len(a) for a in given] == [0, 1, 2]
    assert given[2] == [r.calls[0].text, r.calls[1].text]
    assert "call 1 after 1 answers" in r.calls[1].text


def test_ignore_eos_is_sent_when_asked(hybrid: ModuleType) -> None:
    """The workflows ask every answer to run to its cap: the runtimes' ``ignore_eos``
    travels in the request body (a recording server stands in for the gateway)."""
    from aiohttp import web

    bodies: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"id": "c", "object": "chat.completion", "created": 0,
                                  "model": MODEL, "choices": [{"index": 0, "finish_reason": "length",
                                  "message": {"role": "assistant", "content": "x"}}]})  # fmt: skip

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            for flag in (True, False):
                _, send = hybrid.make_send(f"http://127.0.0.1:{port}/v1", ignore_eos=flag)
                await send([{"role": "user", "content": "hi"}], 5)
        finally:
            await runner.cleanup()

    asyncio.run(go())
    assert bodies[0]["ignore_eos"] is True
    assert "ignore_eos" not in bodies[1]
    assert bodies[0]["max_tokens"] == 5
    assert bodies[0]["temperature"] == 0


def test_repeated_runs_combine_to_medians_and_ranges(hybrid: ModuleType) -> None:
    runs = [
        {"calls": 10, "errors": 1, "first_errors": ["a"], "requests_per_s": 1.0,
         "edge_share": None, "cores": {"gateway": 0.1, "edge": 0.5}, "ok": True},
        {"calls": 10, "errors": 0, "first_errors": [], "requests_per_s": 3.0,
         "edge_share": None, "cores": {"gateway": 0.3, "edge": 0.7}, "ok": True},
        {"calls": 10, "errors": 2, "first_errors": ["b", "c"], "requests_per_s": 2.5,
         "edge_share": None, "cores": {"gateway": 0.2}, "ok": True},
    ]  # fmt: skip
    median, spread = hybrid.combine(runs)
    assert median["requests_per_s"] == 2.5
    assert spread["requests_per_s"] == [1.0, 3.0]
    assert median["errors"] == 3  # summed: every failed call counts
    assert median["first_errors"] == ["a", "b", "c"]
    assert median["cores"] == {"edge": 0.5, "gateway": 0.2}
    assert median["edge_share"] is None
    assert median["ok"] is True  # not a number: kept
    assert "ok" not in spread


def test_the_report_gives_medians_with_their_ranges_and_a_plot(
    hybrid: ModuleType, tmp_path: Path
) -> None:
    def summary(rps: float) -> dict[str, Any]:
        return {"calls": 4, "errors": 0, "first_errors": [], "wall_s": 10.0,
                "session_model_time_p50_s": 1.0, "session_model_time_p95_s": 2.0 / rps,
                "call_latency_p50_s": 0.5, "call_latency_p95_s": 0.9, "requests_per_s": rps,
                "completion_tokens_per_s": 10 * rps, "completion_tokens": 100, "edge_share": None,
                "cascades": 0, "cores": {"cloud": 1.0}, "core_seconds": 20.0,
                "cost_per_million_tokens": 1.0, "provisioned_cost_per_million_tokens": 2.0}  # fmt: skip

    runs = {"monolithic": [summary(1.0), summary(3.0), summary(2.0)], "hybrid": [summary(1.0)] * 3}
    combined = {a: hybrid.combine(r) for a, r in runs.items()}
    report = {
        "date": "d", "machine": "m", "command": "c", "wall_s": 60.0,
        "params": {"workload": "workflows", "shape": "mix", "max_tokens": 64, "repeats": 3,
                   "concurrency": 14, "price_per_core_hour": 0.05},
        "workload": {"sessions": 14, "calls": 44, "scale": {}},
        "describe": {"monolithic": "one", "hybrid": "two"},
        "architectures": {a: c[0] for a, c in combined.items()},
        "spread": {a: c[1] for a, c in combined.items()},
    }  # fmt: skip
    hybrid.write(report, tmp_path / "r")
    md = (tmp_path / "r.md").read_text()
    assert "| requests/s | 2.00 (1.00-3.00) | 1.00 |" in md  # a range only where runs differ
    assert "14 chains of the `mix` workflow shape (44 model calls)" in md
    assert "3 run(s) of each architecture" in md
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert "![" in md


def test_a_flag_the_run_would_ignore_is_refused(
    hybrid: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, needle in (
        (["--workload", "workflows", "--max-calls", "3"], "--max-calls is used only with"),
        (["--shape", "copilot"], "--shape is used only with --workload workflows"),
        (["--workload", "mooncake", "--system-chars", "10"], "--system-chars"),
        (["--architectures", "monolithic", "--edge-quantization", "q8_0"],
         "--edge-quantization is used only by the hybrid"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            hybrid.main(argv)
        assert info.value.code == 2
        assert needle in capsys.readouterr().err


def test_word_similarity(hybrid: ModuleType) -> None:
    assert hybrid.similarity("a b c d", "a b c d") == 1.0
    assert hybrid.similarity("a b c d", "a b x y") == 0.5
    assert hybrid.similarity("", "") == 1.0
    assert hybrid.similarity("a", "") == 0.0


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
    assert got == {"calls": 4, "identical": 0.5, "identical_edge_calls": 0.5, "edge_calls": 2,
                   "similarity": 0.5, "similarity_edge_calls": 0.5}  # fmt: skip


@pytest.mark.parametrize(
    "arch", ["monolithic", "disaggregated", "hybrid", "hybrid-balanced", "hybrid-edge-first"]
)
def test_manifests_are_valid_services_on_two_cores(
    arch: str, hybrid: ModuleType, tmp_path: Path
) -> None:
    import yaml

    from hybridllm_operator.llmservice import builders
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
    table = builders.build_routing_config(service.service())  # what the gateway is given
    assert table["balance"]["enabled"] is (arch == "hybrid-balanced")
    with pytest.raises(ValueError, match="one of"):
        hybrid.manifest("bogus", args)


# --- the projection to the published scale (bench/hybrid/project.py) ----------------------------


@pytest.fixture
def project(bench_module: Any) -> ModuleType:
    return bench_module("bench/hybrid/project.py")  # type: ignore[no-any-return]


@needs_traces
def test_projection_load_counts_only_new_tokens_when_history_is_cached(project: ModuleType) -> None:
    cached, whole = project.load_calls(True), project.load_calls(False)
    assert len(cached.prefill) == len(whole.prefill) > 100
    assert (cached.prefill <= whole.prefill).all()
    assert cached.prefill.sum() < whole.prefill.sum() / 3  # agent history dominates prompts
    assert (cached.output == whole.output).all()
    assert 4 <= cached.calls_per_session <= 40


def test_littles_law_and_the_arrival_rate(project: ModuleType) -> None:
    # 12,000 sessions, 2.4M calls a day, 10 calls each: a session lasts 4,320 s, so 432 s
    # per call, of which the model takes 2 s
    rate = 2_400_000 / 86_400
    assert project.think_time_s(12_000, rate, 10.0, 2.0) == pytest.approx(430.0)
    assert project.think_time_s(1, rate, 10.0, 1e9) == 0.0
    calls = project.Calls(project.np.array([100, 200]), project.np.array([10, 20]), 2.0)
    s = project.stream(calls, 20.0, 500.0, seed=0)
    assert s.num_requests == pytest.approx(10_000, rel=0.05)
    half = project.stream(calls, 20.0, 500.0, seed=0, share=0.5)
    assert half.num_requests == pytest.approx(5_000, rel=0.05)
    assert set(s.input_tokens.tolist()) == {100, 200}


def test_sizing_finds_the_fewest_replicas_that_meet_the_slo(project: ModuleType) -> None:
    cap = project.capacity
    model = cap.CapacityModel(prefill_tok_s=2000.0, tbt_base_s=0.02, tbt_per_seq_s=0.002,
                              kv_max_batch=16)  # fmt: skip
    pool = cap.PoolConfig(capacity=model, slo=cap.Slo(ttft_s=2.0, tbt_s=0.1), max_replicas=10_000)
    calls = project.Calls(project.np.array([400]), project.np.array([50]), 5.0)
    s = project.stream(calls, 8.0, 300.0, seed=1)
    sized = project.size_pool(s, pool, 0.99)
    n = sized["replicas"]
    assert sized["slo_attainment"] >= 0.99
    fewer = project.des.simulate_des(s, pool, project.Static(n - 1), initial_replicas=n - 1)
    assert fewer.slo_attainment < 0.99  # one replica less does not meet it
    assert n >= sized["work_replicas"]  # never below the work the load needs
    # twice the load needs more replicas
    assert project.size_pool(project.stream(calls, 16.0, 300.0, seed=1), pool, 0.99)["replicas"] > n


def test_projection_prices_every_pool(project: ModuleType) -> None:
    arch = {"prefill": {"replicas": 2}, "decode": {"replicas": 3}}
    prices = {"prefill": 1.0, "decode": 2.0}
    assert project.price(arch, prices, 1_000_000) == pytest.approx(8.0)


# --- Mooncake conversations (bench/hybrid/sessions.py) ------------------------------------------

MOONCAKE = TRAJ.parent / "mooncake-2025" / "conversation_trace.jsonl"


def test_mooncake_turns_extend_the_full_blocks_of_the_turn_before(
    sessions: ModuleType, tmp_path: Path
) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 900, "output_length": 50, "hash_ids": [0, 7]},  # alone
        {"timestamp": 5000, "input_length": 1700, "output_length": 512, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 9000, "input_length": 2200, "output_length": 20, "hash_ids": [0, 1, 3, 5, 6]},
        # shares only block 0 (a system prompt), not turn 1's full blocks: another conversation
        {"timestamp": 9500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 9, 10]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    convs = sessions.mooncake_conversations(trace)
    lengths = sorted(len(c) for c in convs)
    assert lengths == [1, 1, 3]
    chain = next(c for c in convs if len(c) == 3)
    assert [t["timestamp"] for t in chain] == [0, 5000, 9000]
    scale = sessions.MooncakeScale(chars_per_block=40, max_tokens=8, max_calls=5, min_calls=3,
                                   think_time_factor=0.001)  # fmt: skip
    [s] = sessions.load_mooncake_sessions(scale, trace)
    texts = [c.messages[0]["content"] for c in s.calls]
    # turn 2 holds turn 1's full blocks (ids 0, 1: 80 characters) and not its partial one
    assert texts[1][:80] == texts[0][:80]
    assert texts[1][80:120] != texts[0][80:120]
    assert texts[2][:120] == texts[1][:120]  # ids 0, 1, 3
    assert len(texts[0]) == 80 + int(40 * (1200 - 1024) / 512)  # the partial block, cut
    assert [c.tool_wait_s for c in s.calls] == pytest.approx([0.005, 0.004, 0.0])  # gaps x 0.001
    # answers: output_length scaled like the prompt (40 characters / 512 tokens, 4 per
    # token), at most max_tokens
    assert [c.max_tokens for c in s.calls] == [2, 8, 1]


@pytest.mark.dev_traces("mooncake-2025/conversation_trace.jsonl")
def test_the_mooncake_trace_gives_multi_turn_sessions(sessions: ModuleType) -> None:
    loaded = sessions.load_mooncake_sessions(sessions.MooncakeScale())
    assert len(loaded) > 100
    assert all(3 <= len(s.calls) <= 6 for s in loaded)
    first = loaded[0].calls
    assert first[1].messages[0]["content"].startswith(first[0].messages[0]["content"][:96])


def test_a_pool_that_prefills_beside_decode_is_sized_at_its_best_step_budget(
    project: ModuleType,
) -> None:
    cap = project.capacity
    # a slow prefill: big chunks stall decode steps past the TBT objective
    model = cap.CapacityModel(prefill_tok_s=400.0, tbt_base_s=0.05, tbt_per_seq_s=0.004,
                              kv_max_batch=16)  # fmt: skip
    pool = cap.PoolConfig(capacity=model, slo=cap.Slo(ttft_s=5.0, tbt_s=0.25), max_replicas=10_000)
    calls = project.Calls(project.np.array([800]), project.np.array([40]), 5.0)
    s = project.stream(calls, 4.0, 300.0, seed=4)
    each = {c: project.size_pool(s, pool.with_(capacity=project.dataclasses.replace(
        model, prefill_chunk_tokens=c)), 0.99)["replicas"] for c in (32, 512)}  # fmt: skip
    best = project.size_best_chunk(s, pool, [32, 512], 0.99)
    assert best["replicas"] == min(each.values())
    assert best["chunk_tokens"] == min(each, key=each.get)
    assert each[32] != each[512]  # the budget matters here
