"""The four multi-request workflow shapes, built from the SWE-agent trajectories' text.

A workflow is a set of chains; a chain's calls run in order, each sent when the previous
one answered, and a call's prompt may hold the chain's earlier answers (a ``Build`` is
given them). Scaled to SmolLM2-135M-Instruct on two cores:

- ``summarise`` (sequential summarisation): each of 4 documents (a trajectory's tool
  outputs) read in 4 parts; a call holds a short instruction, the summary so far (the
  previous answer) and the next part. No long prompt is shared: every part is new text.
- ``copilot`` (interactive copilot): 8 users ask 2 questions each about one shared long
  context (an agent's instructions and a file it viewed, about 700 tokens); the
  questions are short.
- ``multi-agent`` (multi-agent coding): 2 teams of 3 agents (planner, coder, reviewer)
  take 2 rounds of turns; every call holds the team's long instructions and task and the
  transcript so far (every earlier answer of the chain).
- ``mix``: the three at once.

The same shapes run on the cloud engine in-process (``workflows.py``: the batch and output
knobs) and, as sessions, through the gateway on the three architectures (``run.py
--workload workflows``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sessions as sessions_mod

SHAPES = ("summarise", "copilot", "multi-agent", "mix")
SHARED_CHARS = 2400  # a shared long prompt (about 700 tokens)
PART_CHARS = 700  # one part of a document
QUESTION_CHARS = 160
TASK_CHARS = 600

Build = sessions_mod.Build  # a call's messages, given its chain's earlier answers


@dataclass(frozen=True)
class Chain:
    shape: str
    calls: list[Build]


@dataclass(frozen=True)
class Source:
    """The text of one trajectory: instructions, task, tool outputs, the agent's thoughts."""

    system: str
    task: str
    observations: list[str]
    thoughts: list[str]


def load_sources(directory: Path = sessions_mod.SWE_AGENT) -> list[Source]:
    out = []
    for path in sorted(directory.glob("*.traj")):
        history = json.loads(path.read_text()).get("history") or []
        by_role: dict[str, list[str]] = {"system": [], "user": [], "assistant": []}
        for m in history:
            if m.get("role") in by_role:
                by_role[m["role"]].append(sessions_mod._text(m.get("content")))
        users = by_role["user"]
        if not by_role["system"] or len(users) < 3 or len(by_role["assistant"]) < 2:
            continue
        out.append(Source(by_role["system"][0], users[0], users[1:], by_role["assistant"]))
    if len(out) < 4:
        raise SystemExit(f"need 4 usable trajectories under {directory}, found {len(out)}")
    return out


def summarise(sources: list[Source]) -> list[Chain]:
    chains = []
    for src in sources[:4]:
        document = "\n".join(src.observations)
        parts = [document[i * PART_CHARS : (i + 1) * PART_CHARS] for i in range(4)]

        def call(part: str) -> Build:
            def build(previous: list[str]) -> list[dict[str, str]]:
                so_far = previous[-1] if previous else "(nothing yet)"
                return [{"role": "user", "content":
                         "Update the summary of this log with the next part. Keep it short.\n\n"
                         f"Summary so far: {so_far}\n\nNext part:\n{part}"}]  # fmt: skip

            return build

        chains.append(Chain("summarise", [call(p) for p in parts]))
    return chains


def copilot(sources: list[Source]) -> list[Chain]:
    src = sources[0]
    context = (src.system + "\n\nThe file being edited:\n" + "\n".join(src.observations))[
        :SHARED_CHARS
    ]
    questions = [t[:QUESTION_CHARS] for s in sources for t in s.thoughts if t.strip()][:16]

    def call(question: str) -> Build:
        def build(previous: list[str]) -> list[dict[str, str]]:
            return [{"role": "system", "content": context},
                    {"role": "user", "content": question}]  # fmt: skip

        return build

    return [
        Chain("copilot", [call(questions[2 * u]), call(questions[2 * u + 1])]) for u in range(8)
    ]


def team(src: Source) -> Chain:
    """Three agents taking two rounds of turns; every call holds the team's instructions,
    its task and the transcript so far (the chain's earlier answers, in order)."""
    instructions = src.system[: SHARED_CHARS - TASK_CHARS]
    task = src.task[:TASK_CHARS]

    def call(role: str) -> Build:
        def build(previous: list[str]) -> list[dict[str, str]]:
            return [{"role": "system", "content": f"{instructions}\n\nYou are the {role}."},
                    {"role": "user", "content": task + "\n\n" + "\n\n".join(previous)}]  # fmt: skip

        return build

    return Chain("multi-agent", [call(r) for r in ["planner", "coder", "reviewer"] * 2])


def multi_agent(sources: list[Source]) -> list[Chain]:
    return [team(src) for src in sources[1:3]]


def workflow(shape: str, sources: list[Source]) -> list[Chain]:
    if shape == "summarise":
        return summarise(sources)
    if shape == "copilot":
        return copilot(sources)
    if shape == "multi-agent":
        return multi_agent(sources)
    if shape == "mix":
        return summarise(sources) + copilot(sources) + multi_agent(sources)
    raise ValueError(f"workflow shape {shape!r}: one of {', '.join(SHAPES)}")


def as_sessions(chains: list[Chain], max_tokens: int) -> list[sessions_mod.Session]:
    """Each chain as a session for the replay: no tool wait between its calls, each
    call's prompt built from the answers the session got before it."""
    return [
        sessions_mod.Session(
            f"{chain.shape}-{i}",
            [sessions_mod.Call([], max_tokens, 0.0, build=b) for b in chain.calls],
        )
        for i, chain in enumerate(chains)
    ]
