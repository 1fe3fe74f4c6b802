"""SWE-agent trajectories as session shapes, replayed as an arrival stream.

A trajectory has no timestamps; what it gives is the shape of an agentic session: a
sequence of model calls whose prompt is the whole history so far and whose output is
the assistant's message. Tokens are estimated as characters / 4 (no tokenizer is
needed, and the ratio is the usual one for English and code).

`replay` turns shapes into traffic: sessions start as a Poisson process (rate
``session_rate``), each drawn at random from the loaded shapes; within a session a call
starts after the previous call's output is generated (``output / decode_tok_s``) plus
a tool run (exponential, mean ``tool_s``). Every call of a session carries its session
id, and calls of one session share their prefix, so the prefix id of a call is its
session id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridllm_forecaster.errors import TraceFormatError
from hybridllm_forecaster.stream import RequestStream

CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class SessionShape:
    name: str
    input_tokens: list[int]  # per model call
    output_tokens: list[int]


def load_sessions(path: Path) -> list[SessionShape]:
    path = Path(path)
    files = sorted(p for p in path.rglob("*.traj")) if path.is_dir() else [path]
    if not files:
        raise TraceFormatError(path, None, "no *.traj files in folder")
    return [_load_one(f) for f in files]


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal form: [{"type": "text", "text": ...}, ...]
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return "" if content is None else str(content)


def _load_one(path: Path) -> SessionShape:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, exc.lineno, f"invalid JSON: {exc.msg}") from exc
    history = data.get("history") if isinstance(data, dict) else None
    if not isinstance(history, list):
        raise TraceFormatError(path, 1, "a trajectory needs a 'history' list of messages")
    inputs: list[int] = []
    outputs: list[int] = []
    context_chars = 0
    for k, msg in enumerate(history):
        if not isinstance(msg, dict) or "role" not in msg:
            raise TraceFormatError(path, None, f"history[{k}] is not a message with a 'role'")
        n = len(_text(msg.get("content")))
        if msg["role"] == "assistant":
            inputs.append(max(1, round(context_chars / CHARS_PER_TOKEN)))
            outputs.append(max(1, round(n / CHARS_PER_TOKEN)))
        context_chars += n
    if not inputs:
        raise TraceFormatError(path, None, "trajectory has no assistant (model) calls")
    return SessionShape(path.name, inputs, outputs)


def replay(
    shapes: list[SessionShape],
    *,
    duration_s: float = 4 * 3600.0,
    session_rate: float = 0.5,
    tool_s: float = 5.0,
    decode_tok_s: float = 50.0,
    seed: int = 0,
) -> RequestStream:
    """Sessions started at `session_rate` per second over `duration_s`, shapes drawn at random.

    The rate follows a gentle daily-like wave (plus and minus 50% over the duration) so
    that the stream has something for a forecaster to find, as real agent traffic does.
    """
    if not shapes:
        raise ValueError("no session shapes to replay")
    rng = np.random.default_rng(seed)
    peak = session_rate * 1.5
    starts: list[float] = []
    t = 0.0
    while True:  # thinning of a Poisson process with a sinusoidal rate
        t += rng.exponential(1.0 / peak)
        if t >= duration_s:
            break
        rate = session_rate * (1.0 + 0.5 * np.sin(2 * np.pi * t / duration_s - np.pi / 2))
        if rng.random() < rate / peak:
            starts.append(t)
    times: list[float] = []
    tin: list[int] = []
    tout: list[int] = []
    sids: list[int] = []
    for sid, start in enumerate(starts):
        shape = shapes[int(rng.integers(len(shapes)))]
        t = start
        for i, o in zip(shape.input_tokens, shape.output_tokens, strict=True):
            times.append(t)
            tin.append(i)
            tout.append(o)
            sids.append(sid)
            t += o / decode_tok_s + rng.exponential(tool_s)
    order = np.argsort(np.asarray(times), kind="stable")
    sid_arr = np.asarray(sids, dtype=np.int64)[order]
    return RequestStream(
        arrival_s=np.asarray(times)[order],
        input_tokens=np.asarray(tin, dtype=np.int64)[order],
        output_tokens=np.asarray(tout, dtype=np.int64)[order],
        session_ids=sid_arr,
        prefix_ids=[[int(s)] for s in sid_arr],
        source=", ".join(sorted({s.name for s in shapes}))[:200],
        notes=[f"{len(starts)} sessions replayed from {len(shapes)} trajectory shapes"],
    )
