"""Agentic sessions from the SWE-agent trajectories and the Mooncake conversation trace,
scaled to this machine, and their replay.

A trajectory (``../shared/traces/swe-agent/*.traj``) is one agent solving one task: a
system prompt, the task, then turns of model answer (the assistant's thought and action)
and tool output (the observation). Each assistant message is one model call, whose prompt
is the whole history before it: the context grows with every turn, and every call of a
session repeats the same system prompt and task, the shape the architectures are judged
on (prefix sharing, long prompts, short answers).

Scaled to a 135M model on two cores (``Scale``): each message's text is cut to a number
of characters (its head, where a trajectory puts the command and its first output lines)
and the answers to ``max_tokens``; the tool's time between an answer and the next call is
the trajectory's ``execution_time`` where it recorded one, else ``default_tool_wait_s``,
times ``tool_wait_factor``. The history a call sends is the trajectory's own (not what
our model answered), so every architecture gets exactly the same prompts.

The Mooncake conversation trace (``load_mooncake_sessions``) gives multi-turn sessions by
their shared prefix blocks: each turn's prompt is text standing for its 512-token blocks
(the same text for the same block id), so turns share exactly what the trace says they
share, and the waits between turns are the trace's own gaps, scaled.

Workflow shapes (``shapes.py``) are sessions too: their calls are built from the answers
the session got before them (``Call.build``), so a summary carries the previous one.

The replay keeps a session's order: call k+1 is sent only after call k's answer and the
tool's wait. Those waits are the workload's think time, not a stand-in for model time:
every answer comes from the real model behind the real gateway.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from portable import TRACES

ROOT = Path(__file__).resolve().parents[2]
SWE_AGENT = TRACES / "swe-agent"
WORDS = Path(__file__).resolve().parent / "words.txt"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Scale:
    """How a trajectory is shrunk to this machine (every field is reported with results)."""

    system_chars: int = 1200  # the system prompt: the agent's instructions and tool list
    message_chars: int = 300  # every later message (task, answers, observations)
    max_tokens: int = 32  # a call's answer, at most
    max_calls: int = 12  # calls per session, at most (the trace's median is 11)
    default_tool_wait_s: float = 0.3  # where the trajectory recorded no execution_time
    tool_wait_factor: float = 1.0


# A call's messages built from the answers its session got before it, in order: for
# workflows whose next prompt holds an earlier answer (a summary so far, a transcript).
Build = Callable[[list[str]], list[dict[str, str]]]


@dataclass(frozen=True)
class Call:
    messages: list[dict[str, str]]  # fixed (a trace's own history); unused when build is set
    max_tokens: int
    tool_wait_s: float  # after this call's answer, before the next call
    build: Build | None = None

    def prompt(self, answers: list[str]) -> list[dict[str, str]]:
        return self.messages if self.build is None else self.build(list(answers))


@dataclass(frozen=True)
class Session:
    name: str
    calls: list[Call]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # function-calling trajectories: content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def load_trajectory(path: Path, scale: Scale) -> Session:
    """One trajectory as a session of calls, each with the history before it."""
    doc = json.loads(path.read_text())
    steps = doc.get("trajectory") or []
    history: list[dict[str, str]] = []
    calls: list[Call] = []
    for message in doc.get("history") or []:
        role = message.get("role")
        if role not in ROLES:
            continue
        cut = scale.system_chars if role == "system" else scale.message_chars
        text = _text(message.get("content"))[:cut]
        if role == "assistant" and len(calls) < scale.max_calls and history:
            step = steps[len(calls)] if len(calls) < len(steps) else {}
            wait = step.get("execution_time") or scale.default_tool_wait_s
            calls.append(Call([dict(m) for m in history], scale.max_tokens,
                              float(wait) * scale.tool_wait_factor))  # fmt: skip
        history.append({"role": role, "content": text})
    return Session(path.stem, calls)


def load_sessions(scale: Scale, directory: Path = SWE_AGENT) -> list[Session]:
    """Every trajectory with at least two calls, in file-name order."""
    paths = sorted(directory.glob("*.traj"))
    if not paths:
        raise SystemExit(f"no *.traj under {directory} (the SWE-agent traces)")
    sessions = [load_trajectory(p, scale) for p in paths]
    return [s for s in sessions if len(s.calls) >= 2]


MOONCAKE = TRACES / "mooncake-2025" / "conversation_trace.jsonl"
MOONCAKE_BLOCK = 512  # tokens per hash id in the trace


@dataclass(frozen=True)
class MooncakeScale:
    """How the Mooncake conversation trace is shrunk (every field is reported)."""

    chars_per_block: int = 96  # one 512-token trace block becomes this many characters
    max_tokens: int = 32  # an answer, at most (the trace's output length / 512 blocks' worth)
    max_calls: int = 6
    min_calls: int = 3  # conversations with fewer turns are left out
    think_time_factor: float = 0.01  # the trace's gap between turns, times this


def mooncake_conversations(path: Path = MOONCAKE) -> list[list[dict[str, Any]]]:
    """The trace's conversations: a request continues an earlier one when the earlier one's
    full blocks (all its hash ids but the last, partial, one) begin its own. Each
    conversation is the longest chain of such turns from its first request, in order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_full_blocks: dict[tuple[int, ...], int] = {}
    parent: list[int | None] = []
    for j, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        found = None
        for k in range(len(ids) - 1, 1, -1):  # the longest earlier conversation it extends
            found = by_full_blocks.get(ids[:k])
            if found is not None:
                break
        parent.append(found)
        if len(ids) >= 3:
            by_full_blocks[ids[:-1]] = j
    depth = [0] * len(rows)
    for j, p in enumerate(parent):
        depth[j] = 1 if p is None else depth[p] + 1
    deepest: dict[int, int] = {}  # root -> its deepest turn
    for j in range(len(rows)):
        root = j
        while parent[root] is not None:
            root = parent[root]  # type: ignore[assignment]
        if root not in deepest or depth[j] > depth[deepest[root]]:
            deepest[root] = j
    out = []
    for root in sorted(deepest):
        chain, j = [], deepest[root]
        while j is not None:
            chain.append(rows[j])
            j = parent[j]
        out.append(chain[::-1])
    return out


def trace_words() -> list[str]:
    """Words to fill prompts with: ``words.txt`` beside this file, the alphabetic words of
    the first SWE-agent trajectories (kept in the repository, so runs and tests that make
    up their prompts need no trace)."""
    return WORDS.read_text().split()


def _block_text(block_id: int, words: list[str], chars: int) -> str:
    """The same text for the same hash id, so equal ids are an equal prefix for the cache."""
    rng = random.Random(block_id)
    out = ""
    while len(out) < chars:
        out += rng.choice(words) + " "
    return out[:chars]


def load_mooncake_sessions(scale: MooncakeScale, path: Path = MOONCAKE) -> list[Session]:
    """Mooncake conversations as sessions: each turn's prompt is its blocks' text (the same
    text for the same hash id, the last block cut to the turn's length), so turns share the
    prefix the trace says they share; answers are the trace's output length scaled like the
    prompts, at most ``max_tokens``; the wait before the next turn is the trace's gap times
    ``think_time_factor``. Words come from ``words.txt`` (:func:`trace_words`)."""
    words = trace_words()
    sessions = []
    for n, turns in enumerate(mooncake_conversations(path)):
        if len(turns) < scale.min_calls:
            continue
        calls = []
        for i, turn in enumerate(turns[: scale.max_calls]):
            ids = turn["hash_ids"]
            tail = (turn["input_length"] - MOONCAKE_BLOCK * (len(ids) - 1)) / MOONCAKE_BLOCK
            text = "".join(_block_text(h, words, scale.chars_per_block) for h in ids[:-1])
            text += _block_text(ids[-1], words, max(1, int(scale.chars_per_block * tail)))
            answer = turn["output_length"] * scale.chars_per_block / MOONCAKE_BLOCK / 4
            nxt = turns[i + 1] if i + 1 < len(turns) else None
            gap = (nxt["timestamp"] - turn["timestamp"]) / 1000.0 if nxt else 0.0
            calls.append(Call([{"role": "user", "content": text}],
                              max(1, min(scale.max_tokens, round(answer))),
                              gap * scale.think_time_factor))  # fmt: skip
        sessions.append(Session(f"mooncake-{n}", calls))
    return sessions


@dataclass
class CallResult:
    session: str
    index: int
    sent: float  # seconds since the replay's start
    latency_s: float
    completion_tokens: int
    prompt_tokens: int
    tier: str  # the gateway's x-hybridllm-tier
    route: str  # the gateway's x-hybridllm-route (why it went there)
    text: str
    error: str = ""


@dataclass
class SessionResult:
    name: str
    calls: list[CallResult] = field(default_factory=list)

    @property
    def model_time_s(self) -> float:
        """The session's time waiting for the model: its calls' latencies, tool waits left out."""
        return sum(c.latency_s for c in self.calls)


# One call of the API: (messages, max_tokens) -> (text, prompt tokens, completion tokens,
# tier, route). The harness passes the openai client; the tests pass the same.
Send = Callable[[list[dict[str, str]], int], Awaitable[tuple[str, int, int, str, str]]]


async def replay_session(session: Session, send: Send, t0: float) -> SessionResult:
    """The session's calls in order, each after the previous answer and its tool wait."""
    out = SessionResult(session.name)
    for i, call in enumerate(session.calls):
        messages = call.prompt([c.text for c in out.calls])
        sent = time.perf_counter()
        try:
            text, ptoks, ctoks, tier, route = await send(messages, call.max_tokens)
            error = ""
        except Exception as exc:  # noqa: BLE001 (one failed call fails only itself; the session goes on)
            text, ptoks, ctoks, tier, route, error = "", 0, 0, "", "", f"{type(exc).__name__}: {exc}"  # fmt: skip
        out.calls.append(CallResult(session.name, i, sent - t0, time.perf_counter() - sent,
                                    ctoks, ptoks, tier, route, text, error))  # fmt: skip
        if i + 1 < len(session.calls):
            await asyncio.sleep(call.tool_wait_s)  # the tool runs: the agent's think time
    return out


async def replay(
    sessions: list[Session], send: Send, concurrency: int, start_gap_s: float = 0.0
) -> tuple[list[SessionResult], float]:
    """``concurrency`` sessions in flight; a finished one makes room for the next.

    Sessions start ``start_gap_s`` apart at first, so they do not all send their first
    (longest-shared) call at the same instant. Returns the results and the wall time.
    """
    queue = list(reversed(sessions))
    results: list[SessionResult] = []
    t0 = time.perf_counter()

    async def lane(k: int) -> None:
        await asyncio.sleep(k * start_gap_s)
        while queue:
            results.append(await replay_session(queue.pop(), send, t0))

    await asyncio.gather(*(lane(k) for k in range(concurrency)))
    return results, time.perf_counter() - t0
