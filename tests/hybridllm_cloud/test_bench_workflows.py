"""The workflow shapes of bench/hybrid/shapes.py and their run on the real engine
(bench/hybrid/workflows.py).

A workflow's chains must keep their order (a call is sent when the previous one of its
chain answered, and a summary carries the previous answer), the shapes must have the
prefix structure they are chosen for (copilot and multi-agent share a long prompt,
summarise does not), and a run must count what the engine did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hybridllm_cloud.engine import llm_engine

pytestmark = pytest.mark.dev_traces("swe-agent")


@pytest.fixture(scope="module")
def wf(bench_module: Any) -> Any:
    return bench_module("bench/hybrid/workflows.py")


@pytest.fixture(scope="module")
def shapes(bench_module: Any) -> Any:
    return bench_module("bench/hybrid/shapes.py")


def test_shapes_have_the_structure_they_stand_for(shapes: Any) -> None:
    wf = shapes
    sources = wf.load_sources()
    summarise, copilot, agents = wf.summarise(sources), wf.copilot(sources), wf.multi_agent(sources)
    assert [len(c.calls) for c in summarise] == [4] * 4
    assert [len(c.calls) for c in copilot] == [2] * 8
    assert [len(c.calls) for c in agents] == [6] * 2
    # copilot: every call carries the same long context, and a short question
    contexts = {c.calls[i]([])[0]["content"] for c in copilot for i in range(2)}
    assert len(contexts) == 1
    assert len(contexts.pop()) >= 2000
    # summarise: the previous answer is in the next call; the parts differ
    first = summarise[0].calls[0]([])[0]["content"]
    second = summarise[0].calls[1](["THE SUMMARY"])[0]["content"]
    third = summarise[0].calls[2](["OLD SUMMARY", "NEW SUMMARY"])[0]["content"]
    assert "THE SUMMARY" in second
    assert "NEW SUMMARY" in third
    assert "OLD SUMMARY" not in third
    assert first.split("Next part:")[1] != second.split("Next part:")[1]
    # multi-agent: the team's instructions in every call, the transcript growing
    team = wf.multi_agent(sources)[0]
    a = team.calls[0]([])
    b = team.calls[1](["plan: do X"])
    c = team.calls[2](["plan: do X", "code: Y"])
    assert a[0]["content"].split("You are")[0] == b[0]["content"].split("You are")[0]
    assert "plan: do X" in b[1]["content"]
    assert c[1]["content"].index("plan: do X") < c[1]["content"].index("code: Y")
    # a build keeps no state: the same answers give the same prompt, whoever asked before
    assert team.calls[2](["plan: do X", "code: Y"]) == c
    assert len(wf.workflow("mix", sources)) == 4 + 8 + 2
    with pytest.raises(ValueError, match="one of"):
        wf.workflow("bogus", sources)


def test_a_workflow_as_sessions_keeps_its_chains(shapes: Any) -> None:
    chains = shapes.workflow("mix", shapes.load_sources())
    sessions = shapes.as_sessions(chains, 24)
    assert [len(s.calls) for s in sessions] == [len(c.calls) for c in chains]
    assert len({s.name for s in sessions}) == len(sessions)
    call = sessions[0].calls[1]  # a summarise call: its prompt holds the previous answer
    assert call.max_tokens == 24
    assert call.tool_wait_s == 0.0
    assert "SUMMARY 1" in call.prompt(["SUMMARY 1"])[0]["content"]


@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_keeps_chain_order_and_counts_what_the_engine_did(
    wf: Any, shapes: Any, real_model_dir: Path
) -> None:
    engine = llm_engine.LLMEngine.from_path(
        real_model_dir,
        llm_engine.EngineConfig(num_kv_blocks=512, block_size=16, max_num_seqs=4),
    )
    chains = shapes.summarise(shapes.load_sources())[:2]
    seen: list[list[str]] = []
    for chain in chains:  # record what each call was given
        chain.calls[:] = [
            (lambda build: lambda prev: (seen.append(list(prev)), build(prev))[1])(b)
            for b in chain.calls
        ]
    result = wf.run(engine, chains, 3)
    assert result["calls"] == 8
    assert result["output_tokens"] == 8 * 3  # every answer generated to the cap
    assert result["cpu_s"] > 0
    assert result["cpu_s_per_output_token"] == pytest.approx(result["cpu_s"] / 24)
    # each chain's k-th call got the chain's k earlier answers
    assert sorted(len(s) for s in seen) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(a for s in seen for a in s)
    assert not engine.has_unfinished()
