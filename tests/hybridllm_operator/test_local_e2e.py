"""Local mode end to end: `hybridllm up` runs the real model behind the real gateway.

Every service here is started the way a user starts it (the `hybridllm` command in a
subprocess) and spoken to with the `openai` client; readiness and restarts are awaited by
polling `hybridllm status --json` with a deadline.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from hybridllm_common import metrics as names
from hybridllm_operator.local import files

from . import browser

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hybrid-cpu.yaml"
MODEL = "smollm2-135m-instruct"
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
BURST_CLIENTS = 8  # against one edge replica of 4 slots: 4 queued, within its spill depth (8)
LONG = [
    {
        "role": "user",
        "content": "Summarise this text. " + "The quick brown fox jumps over the lazy dog. " * 60,
    }
]
HYBRIDLLM = (sys.executable, "-m", "hybridllm_common.cli")
START_TIMEOUT_S = 600.0  # a cold machine converts the model for the cloud tier first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    """Nothing listens there: a server (which sets SO_REUSEADDR) could bind it now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def hybridllm(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*HYBRIDLLM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"hybridllm {' '.join(args)}: {result.stdout}\n{result.stderr}")
    return result


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
    start = time.monotonic()
    while not condition():
        if time.monotonic() > start + timeout_s:
            raise TimeoutError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.2)
    print(f"[{time.monotonic() - start:6.1f}s] {what}", file=sys.stderr)  # shown with -s


@dataclass
class Local:
    name: str
    root: Path
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)

    def status(self) -> dict[str, Any]:
        out = hybridllm("status", self.name, "--json", "--state-root", str(self.root), check=False)
        return json.loads(out.stdout) if out.stdout else {}

    def process(self, name: str) -> dict[str, Any]:
        return next(p for p in self.status()["processes"] if p["name"] == name)

    def pids(self) -> list[tuple[int, int | None]]:
        return [(p["pid"], p["start_time"]) for p in self.status()["processes"] if p["pid"]]

    def down(self) -> subprocess.CompletedProcess[str]:
        return hybridllm("down", self.name, "--state-root", str(self.root), check=False)


def _up_detached(root: Path, manifest: Path, name: str, *args: str) -> Local:
    port = _free_port()
    hybridllm(
        "up",
        "-d",
        "-f",
        str(manifest),
        "--state-root",
        str(root),
        "--port",
        str(port),
        *args,
        timeout=START_TIMEOUT_S + 30,
    )
    return Local(name, root, port)


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        **kw,  # type: ignore[arg-type]
    )
    return raw.headers["x-hybridllm-tier"], raw.parse().choices[0].message.content or ""


def _stream(
    client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int = 16
) -> tuple[str, str, str | None]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    text, finish = [], None
    for chunk in raw.parse():
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return raw.headers["x-hybridllm-tier"], "".join(text), finish


class _Clients:
    """``n`` clients asking back to back, each on a thread of its own, from ``start`` to
    ``stop``: what they were answered (``ask``'s result) and how they failed."""

    def __init__(self, n: int, client: Callable[[], openai.OpenAI],
                 ask: Callable[[openai.OpenAI], str]) -> None:  # fmt: skip
        self.answered: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(client, ask), daemon=True) for _ in range(n)
        ]

    def _run(
        self, client: Callable[[], openai.OpenAI], ask: Callable[[openai.OpenAI], str]
    ) -> None:
        c = client()
        while not self._stop.is_set():
            try:
                self.answered.append(ask(c))
            except openai.OpenAIError as exc:
                self.failures.append(repr(exc))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=120)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    local = _up_detached(tmp_path_factory.mktemp("local"), EXAMPLE, "smollm2-cpu")
    yield local
    local.down()


def test_up_serves_both_tiers_through_the_gateway(hybrid: Local) -> None:
    state = hybrid.status()
    assert state["phase"] == "ready"
    assert {p["name"]: p["status"] for p in state["processes"]} == {
        "edge-0": "ready",
        "monolithic-0": "ready",
        "gateway-0": "ready",
        # the example scales: one slot more per pool, started when the load asks for it
        "edge-1": "standby",
        "monolithic-1": "standby",
    }
    assert state["autoscaling"]["mode"] == "reactive"
    # "ready" waits for the gateway to serve every ready replica (it reloads the table
    # naming the last of them within a second; a table of one tier routed everything
    # there: the long prompt once came back from the edge)
    gateway_metrics = httpx.get(hybrid.base_url.removesuffix("/v1") + "/metrics", timeout=10)
    for tier in ("edge", "cloud"):
        assert (
            f'{names.GATEWAY_REVISION_HEALTHY_BACKENDS}{{revision="v1",tier="{tier}"}} 1.0'
            in gateway_metrics.text
        )
    client = hybrid.client()
    assert MODEL in [m.id for m in client.models.list().data]
    tier, text = _chat(client, SHORT)
    assert tier == "edge"
    assert text.strip()
    tier, text = _chat(client, LONG)  # beyond edgeLimits.maxPromptTokens
    assert tier == "cloud"
    assert text.strip()
    for messages, expected in ((SHORT, "edge"), (LONG, "cloud")):
        tier, text, finish = _stream(client, messages)
        assert tier == expected
        assert text.strip()
        assert finish in ("stop", "length")
    # a runtime answers its gateway only (the supervisor's backend token): a client that
    # skips the gateway (its keys, limits, filter and tenant salt) is refused by name;
    # probes and metrics stay open
    for name in ("edge-0", "monolithic-0"):
        url = hybrid.process(name)["url"]
        direct = httpx.post(url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "messages": SHORT, "max_tokens": 4, "cache_salt": "tenant-a"})  # fmt: skip
        assert direct.status_code == 401, direct.text
        assert direct.json()["error"]["code"] == "unauthorized"
        assert "answers its gateway only" in direct.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    # `hybridllm profile` measures the running edge replica directly (with the service's
    # backend token) and gives its capacity block, in the units the autoscaler counts
    got = json.loads(hybridllm(
        "profile", hybrid.name, "--pool", "edge", "--state-root", str(hybrid.root),
        "--requests", "3", "--max-tokens", "8", "--prompt-repeats", "4,64", "--json",
    ).stdout)  # fmt: skip
    assert got["url"] == hybrid.process("edge-0")["url"]
    assert (got["levels"], got["answers"]) == ([1, 2, 4], 3 * 2 + 3 * 7)
    assert got["prefillTokensPerSecond"] > 0, got
    assert got["decodeTokensPerSecond"] > 0, got


def test_a_killed_replica_is_restarted_and_requests_keep_succeeding(hybrid: Local) -> None:
    edge = hybrid.process("edge-0")
    failures: list[BaseException] = []
    served = {"edge": 0, "cloud": 0}
    stop = threading.Event()

    def load() -> None:
        client = hybrid.client()
        while not stop.is_set():
            try:
                tier, _ = _chat(client, SHORT)
                served[tier] += 1
            except openai.OpenAIError as exc:  # every failure is reported below
                failures.append(exc)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_for("load reaches the edge", lambda: served["edge"] >= 2)
        os.kill(edge["pid"], signal.SIGKILL)
        wait_for(
            "edge-0 restarted and ready",
            lambda: (
                (p := hybrid.process("edge-0"))["restarts"] == edge["restarts"] + 1
                and p["status"] == "ready"
            ),
        )
        before = served["edge"]
        wait_for("the restarted edge serves again", lambda: served["edge"] > before)
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not failures, failures[:3]
    after = hybrid.process("edge-0")
    assert after["pid"] != edge["pid"]
    assert after["last_exit"] == "signal SIGKILL"
    logs = hybridllm("logs", hybrid.name, "edge-0", "-n", "0", "--state-root", str(hybrid.root))
    assert logs.stdout.count("==== ") == 2, "one log per replica, a header per start"


TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                    "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "description": "Look up a word",
     "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 20}},
                    "required": ["word"]}}},
]  # fmt: skip


def _json_answer(client: openai.OpenAI, tier: str, entry: dict[str, Any]) -> tuple[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": entry["prompt"]}],
        max_tokens=160,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {  # type: ignore[typeddict-item]
            "name": entry["name"], "schema": entry["schema"], "strict": True}},
        extra_headers={"x-hybridllm-tier": tier},
    )  # fmt: skip
    return raw.headers["x-hybridllm-tier"], raw.parse().choices[0]


def _agent_loop(base_url: str, tier: str) -> tuple[Any, list[tuple[str, ...]], Any]:
    """pydantic-ai (a framework no one here wrote) runs a two-tool agent on one tier: each
    tool may be called once (its ``prepare`` drops it after), and the run ends in a typed
    answer, which pydantic-ai asks for as one more tool call (tool_choice "required")."""
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, RunContext, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.usage import UsageLimits

    calls: list[tuple[str, ...]] = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append(("add", str(a), str(b)))
        return a + b

    def lookup(word: str) -> str:
        """Look up the meaning of a word in the dictionary."""
        calls.append(("lookup", word))
        return f"{word}: a round fruit"

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if any(c[0] == tool.name for c in calls) else tool

    class Answer(BaseModel):
        total: int
        meaning: str = Field(max_length=40)

    model = OpenAIChatModel(f"{MODEL}:{tier}", provider=OpenAIProvider(
        base_url=base_url, api_key="unused"))  # fmt: skip
    agent = Agent(model, tools=[Tool(add, prepare=once), Tool(lookup, prepare=once)],
                  output_type=Answer, model_settings=ModelSettings(temperature=0, max_tokens=96))  # fmt: skip
    result = agent.run_sync(
        "What is 2 plus 3, and what does the word 'apple' mean? Use the tools.",
        usage_limits=UsageLimits(request_limit=4),
    )
    return result, calls, Answer


def test_agents_get_valid_json_and_tool_calls_from_both_tiers(hybrid: Local) -> None:
    """Structured output and tool calls through the gateway, on each tier, with the real
    model: every answer of the schema corpus validates; required and named tool choices give
    calls whose arguments validate, streamed or not; a tool result is answered in the next
    turn; an agent framework's tool loop finishes."""
    import jsonschema

    client = openai.OpenAI(base_url=hybrid.base_url, api_key="unused", max_retries=0, timeout=600)
    corpus = json.loads((REPO / "tests" / "data" / "structured-schemas.json").read_text())
    jobs = [(tier, e) for tier in ("edge", "cloud") for e in corpus["schemas"]]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _json_answer(client, *job), jobs))
    for (tier, entry), (served, choice) in zip(jobs, answers, strict=True):
        assert served == tier
        assert choice.finish_reason == "stop", (tier, entry["name"], choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), entry["schema"])
    # the edge's response cache keys the schema: the same prompt under another schema is
    # answered under that one, not from the cache
    again = {**corpus["schemas"][0], "schema": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}  # fmt: skip
    _, choice = _json_answer(client, "edge", again)
    assert list(json.loads(choice.message.content or "")) == ["n"]

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    for tier in ("edge", "cloud"):
        for choice_ in ("required", {"type": "function", "function": {"name": "lookup"}}):
            resp = client.chat.completions.create(
                model=f"{MODEL}:{tier}", messages=question, max_tokens=96, temperature=0,
                tools=TOOLS, tool_choice=choice_,  # type: ignore[arg-type]
            )  # fmt: skip
            (call,) = resp.choices[0].message.tool_calls or []
            assert resp.choices[0].finish_reason == "tool_calls"
            assert call.id.startswith("call_")
            if isinstance(choice_, dict):
                assert call.function.name == "lookup"  # type: ignore[union-attr]
            args = json.loads(call.function.arguments)  # type: ignore[union-attr]
            jsonschema.validate(args, schemas[call.function.name])  # type: ignore[union-attr]
            stream = client.chat.completions.create(
                model=f"{MODEL}:{tier}", messages=question, max_tokens=96, temperature=0,
                tools=TOOLS, tool_choice=choice_, stream=True,  # type: ignore[arg-type]
            )  # fmt: skip
            deltas, finish = [], None
            for chunk in stream:
                for c in chunk.choices:
                    deltas += c.delta.tool_calls or []
                    finish = c.finish_reason or finish
            assert finish == "tool_calls"
            assert [(d.function.name, d.function.arguments) for d in deltas] == [  # type: ignore[union-attr]
                (call.function.name, call.function.arguments)  # type: ignore[union-attr]
            ]
        # the tool's result, in the next turn, is answered in text
        follow = client.chat.completions.create(
            model=f"{MODEL}:{tier}", max_tokens=48, temperature=0, tools=TOOLS,  # type: ignore[arg-type]
            messages=[*question, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}],  # type: ignore[list-item]
        )  # fmt: skip
        assert follow.choices[0].finish_reason in ("stop", "length")
        assert "5" in (follow.choices[0].message.content or "")
        result, calls, answer_type = _agent_loop(hybrid.base_url, tier)
        assert isinstance(result.output, answer_type)
        assert calls, "the agent called no tool"
        assert result.usage.requests <= 4
        assert result.output.total == 5  # read from the add tool's result
    metrics = httpx.get(hybrid.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    for tier in ("edge", "cloud"):
        assert f'{names.GATEWAY_REQUEST_KINDS_TOTAL}{{kind="tools",tier="{tier}"}}' in metrics
        assert f'{names.GATEWAY_REQUEST_KINDS_TOTAL}{{kind="structured",tier="{tier}"}}' in metrics


def test_a_burst_on_the_example_is_named_saturated(hybrid: Local) -> None:
    """The new user's burst (#52) on `make up`'s manifest as it ships (capacity left out,
    reactive, 15 s intervals): 8 clients back to back with long prompts keep the cloud
    replica's time to first token far over the SLO while its token rate is a sliver of what
    the default capacity (an 8B model on an H100) calls one replica's: the case where the
    token rate alone held the pool at one, without a word. Within two intervals of the
    first answers the pool's decision names the saturation; on a machine whose cores the
    running replicas already hold (CI's two) it says capacity-bound and starts nothing
    that would slow every replica down, elsewhere it scales up. No request fails."""

    def cloud() -> dict[str, Any]:
        return dict(hybrid.status()["autoscaling"]["pools"]["monolithic"])

    load = _Clients(8, hybrid.client, lambda c: _chat(c, LONG)[0])
    try:
        load.start()
        wait_for("the first answers", lambda: len(load.answered) > 0, timeout_s=120)
        wait_for(
            "the cloud pool's decision to name the saturation",
            lambda: "saturated (cloud p95 time to first token" in cloud()["reason"],
            timeout_s=2 * 15 + 5,  # two autoscaler intervals, and the status write
        )  # fmt: skip
        decision = cloud()
    finally:
        load.stop()
    assert load.failures == [], load.failures[:3]
    assert set(load.answered) == {"cloud"}
    cores = os.cpu_count() or 1
    if cores <= 2:  # edge-0 and monolithic-0 hold a core each
        assert decision["reason"].startswith("capacity-bound while saturated"), decision
        assert f"this machine has {cores} cores" in decision["reason"], decision
        assert decision["desired"] == 1
        assert hybrid.process("monolithic-1")["status"] == "standby"
    else:
        assert decision["reason"].startswith("scale up to 2: saturated"), decision
        assert decision["desired"] == 2


def test_down_drains_a_stream_in_flight_then_leaves_nothing(hybrid: Local) -> None:
    pids = hybrid.pids()
    ports = [p["port"] for p in hybrid.status()["processes"]]
    assert len(pids) >= 3  # the gateway, edge and cloud replicas (more if it scaled up)
    result: dict[str, Any] = {}

    def stream() -> None:
        try:
            result["out"] = _stream(hybrid.client(), LONG, max_tokens=64)
        except openai.OpenAIError as exc:
            result["error"] = exc

    streaming = threading.Thread(target=stream)
    streaming.start()
    wait_for(
        "the stream is running on the cloud replica",
        lambda: (
            "hybridllm_num_requests_running 1.0"
            in httpx.get(hybrid.process("monolithic-0")["url"] + "/metrics").text
        ),
        timeout_s=60,
    )
    down = hybrid.down()
    streaming.join(timeout=120)
    assert down.returncode == 0, down.stderr
    assert "error" not in result, result.get("error")
    tier, _, finish = result["out"]
    assert tier == "cloud"
    assert finish in ("stop", "length")
    for pid, start_time in pids:
        assert not files.is_alive(pid, start_time), f"pid {pid} outlived `down`"
    assert all(_port_free(p) for p in ports)
    assert not (hybrid.root / hybrid.name / "state.json").exists()
    assert (
        hybridllm("status", hybrid.name, "--state-root", str(hybrid.root), check=False).returncode
        == 1
    )


def test_ctrl_c_on_a_foreground_up_stops_every_process(tmp_path: Path) -> None:
    port = _free_port()
    up = subprocess.Popen(
        [*HYBRIDLLM, "up", "-f", str(EXAMPLE), "--state-root", str(tmp_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    local = Local("smollm2-cpu", tmp_path, port)
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "is ready at" in line:
                break
        else:
            pytest.fail("up exited before ready:\n" + "".join(lines))
        tier, _ = _chat(local.client(), SHORT)
        assert tier == "edge"
        pids = local.pids()
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, rest
    assert "SIGINT: draining, then stopping" in rest
    assert all(not files.is_alive(pid, t) for pid, t in pids)
    assert _port_free(port)
    assert not (tmp_path / "smollm2-cpu" / "state.json").exists()


def test_disaggregated_cloud_prefills_remotely_and_a_dead_supervisor_takes_its_children(
    tmp_path: Path,
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "disagg-cpu"
    cloud = doc["spec"]["cloud"]
    pool = cloud.pop("monolithic")
    cloud.update(mode="disaggregated", prefill=pool, decode=pool, localPrefillThreshold=32)
    doc["spec"]["edge"] = {"enabled": False}
    doc["spec"]["routing"] = {"policy": "cloud-only"}
    manifest = tmp_path / "disagg.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    local = _up_detached(tmp_path / "state", manifest, "disagg-cpu")
    try:
        tier, text = _chat(local.client(), LONG)
        assert tier == "cloud"
        assert text.strip()
        metrics = httpx.get(local.process("decode-0")["url"] + "/metrics").text
        remote = [
            line
            for line in metrics.splitlines()
            if line.startswith("hybridllm_prefills_total{") and 'where="remote"' in line
        ]
        assert any('outcome="ok"' in line and not line.endswith(" 0.0") for line in remote), remote
        state = local.status()
        children = local.pids()
        os.kill(state["supervisor_pid"], signal.SIGKILL)
        wait_for(
            "every child exits with its supervisor",
            lambda: not any(files.is_alive(pid, t) for pid, t in children),
            timeout_s=60,
        )
        status = hybridllm("status", local.name, "--state-root", str(local.root), check=False)
        assert status.returncode == 1
        assert "not running" in status.stdout
    finally:
        down = local.down()
    assert down.returncode == 0
    assert not (local.root / local.name / "state.json").exists()


@dataclass
class _Outcome:
    started: bool = False  # a content chunk arrived before the end or the error
    finished: bool = False  # a finish_reason arrived
    error: str | None = None


def test_killing_one_of_three_cloud_replicas_fails_no_request_that_had_not_started(
    tmp_path: Path,
) -> None:
    """Streams run against three cloud replicas behind the gateway; one replica is killed.
    Every request that had not received a token by then completes (the gateway retries
    it on another replica); a stream cut mid-way ends in an error the client sees, never
    in a silent truncation."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "three-cpu"
    doc["spec"]["edge"] = {"enabled": False}
    doc["spec"]["routing"] = {"policy": "cloud-only"}
    doc["spec"]["cloud"]["monolithic"]["replicas"] = 3
    doc["spec"]["cloud"]["monolithic"]["maxReplicas"] = 3
    doc["spec"]["autoscaling"] = {"mode": "off"}  # three replicas throughout
    manifest = tmp_path / "three.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    local = _up_detached(tmp_path / "state", manifest, "three-cpu")
    outcomes: list[_Outcome] = []
    killed = threading.Event()
    stop = threading.Event()

    def client_loop() -> None:
        client = local.client()
        while not stop.is_set():
            out = _Outcome()
            outcomes.append(out)
            try:
                stream = client.chat.completions.create(
                    model=MODEL, messages=SHORT, max_tokens=24, temperature=0, stream=True
                )
                for chunk in stream:
                    for choice in chunk.choices:
                        out.started = out.started or bool(choice.delta.content)
                        out.finished = out.finished or choice.finish_reason is not None
            except openai.OpenAIError as exc:
                out.error = repr(exc)

    threads = [threading.Thread(target=client_loop) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        wait_for("streams complete before the kill", lambda: sum(o.finished for o in outcomes) >= 6)
        victim = local.process("monolithic-1")
        os.kill(victim["pid"], signal.SIGKILL)
        killed.set()
        done_at_kill = len(outcomes)
        wait_for(
            "streams complete after the kill",
            lambda: sum(o.finished for o in outcomes[done_at_kill:]) >= 12,
            timeout_s=180,
        )
        wait_for(
            "the killed replica is back",
            lambda: (
                (p := local.process("monolithic-1"))["restarts"] == 1 and p["status"] == "ready"
            ),
            timeout_s=180,
        )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        local.down()
    finished = [o for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    truncated = [o for o in finished if not o.finished]
    assert not truncated, f"{len(truncated)} streams ended without a finish_reason or an error"
    assert all(o.started for o in failed), [o.error for o in failed if not o.started]
    assert len(finished) >= 18


def test_the_local_autoscaler_starts_a_replica_under_load_and_retires_it_when_idle(
    tmp_path: Path, testenv: Any
) -> None:
    """`hybridllm up` of the example, edge only (the machine's two cores hold two edge
    replicas), its capacity left out and its reactive mode as the example has them: 8
    clients asking back to back take the edge pool from one replica to two, both in the
    routing table, and the autoscaler takes the pool's speed from the gateway (status:
    "learned from N answers", or which figure the answers do not measure yet); idle, the
    second is retired (out of the table, then SIGTERM) and its slot goes back on standby:
    one scale change each way, no flapping. No request fails.

    Under the load, the dashboard page (`--metrics`, fed by a real Prometheus scraping the
    supervisor's scrape-targets.json) opened in headless Chromium draws the traffic and the
    autoscaler's panels with data, and logs nothing to the console. With
    HYBRIDLLM_DASHBOARD_SCREENSHOT=PATH it also saves a screenshot there (docs/images)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "scaler"
    doc["spec"]["cloud"] = {"enabled": False}
    doc["spec"]["routing"]["policy"] = "edge-only"
    doc["spec"]["gateway"] = {"requestsPerMinute": 100_000}  # clients back to back
    assert "capacity" not in doc["spec"]["edge"]["pool"]  # learned, as a new user's would be
    assert doc["spec"]["autoscaling"]["mode"] == "reactive"
    doc["spec"]["autoscaling"].update(intervalSeconds=5, scaleDownDelaySeconds=5)
    manifest = tmp_path / "scaler.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    metrics_port = _free_port()
    prometheus_state = tmp_path / "prometheus-state"
    prometheus = testenv.prometheus_up(
        prometheus_state, targets=tmp_path / "root" / "scaler" / files.SCRAPE_FILE
    )
    try:
        _autoscale_and_look(tmp_path, manifest, metrics_port, prometheus)
    finally:
        testenv.stop(prometheus_state, "prometheus")


def _autoscale_and_look(tmp_path: Path, manifest: Path, metrics_port: int, prometheus: str) -> None:
    local = _up_detached(
        tmp_path / "root", manifest, "scaler", "--metrics", f"127.0.0.1:{metrics_port}",
        "--prometheus-url", prometheus,
    )  # fmt: skip
    # streamed (the gateway learns a replica's speed from those), each prompt new (no
    # answer from the edge's cache) and of its own length, 10 to 190 tokens (a prefill
    # rate needs prompts of different lengths to be measured)
    asked = itertools.count()

    def question(c: openai.OpenAI) -> str:
        i = next(asked)
        words = "the quick brown fox " * (4 * (i % 12))
        return _stream(c, [{"role": "user", "content": f"({i}) {words}Name a colour."}])[1]

    load = _Clients(BURST_CLIENTS, local.client, question)
    try:
        assert local.process("edge-1")["status"] == "standby"
        load.start()
        wait_for(
            "a second edge replica ready", lambda: local.process("edge-1")["status"] == "ready",
            timeout_s=180,
        )  # fmt: skip
        log = (tmp_path / "root" / "scaler" / "supervisor.log").read_text()
        assert "autoscaler: edge 1 -> 2 replicas (scale up to 2:" in log, log[-3000:]
        assert local.status()["autoscaling"]["pools"]["edge"]["desired"] == 2
        # the operator's metrics, from the same autoscaler, in local mode
        exported = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        pool = 'llmservice="scaler",namespace="local",pool="edge"'
        assert f"{names.AUTOSCALER_DESIRED_REPLICAS}{{{pool}}} 2.0" in exported, exported
        ups = f'{names.AUTOSCALER_SCALE_EVENTS_TOTAL}{{direction="up",{pool}}} '
        assert float(exported.split(ups)[1].split()[0]) >= 1, exported
        routing = json.loads((tmp_path / "root" / "scaler" / "routing.json").read_text())
        assert len(routing["tiers"]["edge"]["backends"]) == 2
        _look_at_the_page(f"http://127.0.0.1:{metrics_port}", "local", "scaler")
        # the gateways' measurements reach the autoscaler: the pool's capacity is learned
        # from them, or the status says which figure they do not measure yet
        wait_for(
            "the edge pool's speed learned, or why not",
            lambda: not local.status()["autoscaling"]["capacity"]["edge"].startswith("defaults until"),
            timeout_s=120,
        )  # fmt: skip
        said = local.status()["autoscaling"]["capacity"]["edge"]
        assert said.startswith("learned from") or "answers do not measure" in said, said
        load.stop()
        wait_for(
            "the second replica retired", lambda: local.process("edge-1")["status"] == "standby",
            timeout_s=120,
        )  # fmt: skip
        assert local.process("edge-1")["pid"] is None
        exported = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        for direction in ("up", "down"):  # one change each way: no flapping
            line = f'{names.AUTOSCALER_SCALE_EVENTS_TOTAL}{{direction="{direction}",{pool}}} '
            assert float(exported.split(line)[1].split()[0]) == 1, exported
        assert local.process("edge-0")["status"] == "ready"
        assert _chat(local.client(), SHORT)[0] == "edge"  # the one left serves
    finally:
        load.stop()
        local.down()
    assert load.failures == [], load.failures[:3]
    assert len(load.answered) > 0


def _look_at_the_page(url: str, namespace: str, name: str) -> None:
    """The service's page in headless Chromium once Prometheus holds the gateway's traffic
    and the autoscaler's decisions."""
    api = f"{url}/api/v1/services/{namespace}/{name}/panels"

    def has_data(dashboard: str, index: int, **params: str) -> bool:
        body = httpx.get(f"{api}/{dashboard}/{index}", params=params, timeout=30).json()
        return any(p[1] for s in body.get("series", []) for p in s["points"])

    wait_for("Prometheus to hold the gateway's requests",
             lambda: has_data("service", 0, range="5m"), timeout_s=120)  # fmt: skip
    wait_for("Prometheus to hold the autoscaler's decisions",
             lambda: has_data("autoscaling", 1, range="5m", pool="edge"), timeout_s=60)  # fmt: skip
    page = f"{url}/services/{namespace}/{name}?range=5m"
    loaded = browser.load(page)
    body, shown = browser.panels_of(loaded.dom)
    assert body.get("data-loaded") == "1", loaded.dom[-2000:]
    assert loaded.console == []
    states = {(p["data-section"], p["data-title"]): p["data-state"] for p in shown}
    assert not {"error", "loading"} & set(states.values()), states
    for key in [
        ("service", "Requests per second by tier"),
        ("service", "Tokens per second by tier"),
        ("service", "Time to first token"),
        ("service", "Edge share"),
        ("autoscaling:edge", "Demand and forecast (replicas at target)"),
        ("autoscaling:edge", "Replicas: desired, provisioned, ready"),
        ("autoscaling:edge", "Scaling decisions"),
    ]:
        assert states[key] == "ok", (key, states)
    replicas = next(p for p in shown if p["data-title"] == "Replicas: desired, provisioned, ready")
    assert replicas["data-series"] == "3"  # the supervisor's replicas, as a reconcile's
    target = os.environ.get("HYBRIDLLM_DASHBOARD_SCREENSHOT")
    if target:
        browser.screenshot(page, Path(target))


def _revision_answers(local: Local) -> dict[str, float]:
    """Requests each revision answered, from the gateway's per-revision counters."""
    from hybridllm_operator.llmservice import analysis

    text = httpx.get(f"http://127.0.0.1:{local.port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for (_, revision, result), value in analysis.parse_revision_metrics(text).counters.items():
        if result == "ok":
            out[revision] = out.get(revision, 0.0) + value
    return out


def test_a_local_rollout_promotes_a_requantized_revision_and_rolls_back_bad_ones(
    tmp_path: Path,
) -> None:
    """`hybridllm apply` of a new revision to a running edge service: the operator's
    rollout runs in the supervisor. A canary replica starts beside the stable one, takes
    half the traffic, passes the step's analysis (on the gateway's metrics), is promoted
    by hand at the last step (`hybridllm rollout promote --local`), the stable replica is
    restarted on the new revision (the model re-quantized to Q8_0) and the canary retired. A revision whose model fails its
    sha256 check crashes on start: the rollout aborts and the stable revision keeps every
    request. A revision whose context window (300 tokens) is too short for a golden prompt
    is aborted before any traffic reaches it. A change to what shapes the processes (a
    pool's maximum) is refused with the field named. One client asks back to back throughout, and no request
    fails."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "canary"
    doc["spec"]["cloud"] = {"enabled": False}
    doc["spec"]["routing"]["policy"] = "edge-only"
    # one client, back to back
    doc["spec"]["gateway"] = {"requestsPerMinute": 100_000, "tokensPerMinute": 10_000_000}
    doc["spec"]["edge"]["pool"].update(replicas=1, minReplicas=1, maxReplicas=1)
    doc["spec"]["routing"]["edgeLimits"] = {"maxPromptTokens": 128, "maxOutputTokens": 64}
    doc["spec"]["rollout"] = {
        "strategy": "canary",
        "steps": [{"weight": 50, "pauseSeconds": 10}, {"weight": 100, "pauseSeconds": 3600}],
        "analysis": {
            "intervalSeconds": 5,
            "minRequests": 3,
            "goldenPrompts": [
                {"prompt": "What is the capital of France? Answer in one word.", "expect": "paris"},
                {"prompt": LONG[0]["content"], "expect": "fox", "maxTokens": 16},  # 637 tokens
            ],
        },
    }
    manifest = tmp_path / "canary.yaml"

    def write(revision: str, **model: Any) -> None:
        doc["spec"]["model"]["revision"] = revision
        doc["spec"]["model"].update(model)
        manifest.write_text(yaml.safe_dump(doc))

    write("v1")
    root = tmp_path / "root"
    local = _up_detached(root, manifest, "canary")
    state_root = ("--state-root", str(root))
    log = root / "canary" / files.SUPERVISOR_LOG

    def rollout() -> dict[str, Any]:
        return local.status().get("rollout") or {}

    def names_() -> set[str]:
        return {p["name"] for p in local.status()["processes"]}

    failures: list[str] = []
    stop = threading.Event()

    def ask() -> None:
        client = local.client()
        for i in itertools.count():  # a new question each time: no answer from a cache
            if stop.is_set():
                return
            try:
                _chat(client, [{"role": "user", "content": f"Name a French city ({i})."}])
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    asker = threading.Thread(target=ask, daemon=True)
    try:
        wait_for("the first rollout state", lambda: rollout().get("phase") == "Completed")
        asker.start()
        stable = local.process("edge-0")
        assert stable["revision"] == "v1"

        # ---- a good revision, the model re-quantized to Q8_0: a canary at 50%, analysed,
        # then promoted by hand at 100%
        doc["spec"]["edge"]["quantization"] = "q8_0"
        write("v2")
        out = hybridllm("apply", "-f", str(manifest), *state_root)
        assert "revision v1 -> v2 applied" in out.stdout
        wait_for(
            "the canary replica ready", lambda: local.process("edge-canary-0")["status"] == "ready"
        )
        assert local.process("edge-canary-0")["revision"] == "v2"
        wait_for("the first step analysed and passed", lambda: rollout().get("step") == 1,
                 timeout_s=180)  # fmt: skip
        assert "RolloutStepPassed: step 1/2 passed" in log.read_text()
        answered = _revision_answers(local)
        assert answered.get("v1", 0) > 0, answered
        assert answered.get("v2", 0) > 0, answered
        wait_for("every request on the canary at the last step",
                 lambda: rollout().get("weight") == 100)  # fmt: skip
        shown = hybridllm("rollout", "status", "canary", "--local", *state_root).stdout
        assert "canary revision: v2" in shown, shown
        assert "step:            2/2" in shown, shown
        assert "golden prompts:  2 golden prompt(s) answered right by v2 on edge" in shown, shown
        hybridllm("rollout", "promote", "canary", "--local", *state_root)
        wait_for("the rollout completed", lambda: rollout().get("phase") == "Completed",
                 timeout_s=180)  # fmt: skip
        wait_for("the canary retired", lambda: names_() == {"edge-0", "gateway-0"})
        promoted = local.process("edge-0")
        assert (promoted["revision"], promoted["status"]) == ("v2", "ready")
        assert promoted["pid"] != stable["pid"]
        assert promoted["restarts"] == 0  # a restart on the new revision is not a crash
        starts = [
            line
            for line in (root / "canary" / "logs" / "edge-0.log").read_text().splitlines()
            if line.startswith("==== ")
        ]
        assert "--quantization q4_1" in starts[0]
        assert "--quantization q8_0" in starts[-1]
        routing = json.loads((root / "canary" / "routing.json").read_text())
        assert [(b["revision"], b["weight"]) for b in routing["tiers"]["edge"]["backends"]] == [
            ("v2", 100)
        ]
        assert rollout()["stableRevision"] == "v2"
        assert "GoldenPromptsPassed: 2 golden prompt(s) answered right by v2 on edge" in (
            log.read_text()
        )

        # ---- a revision that cannot load: aborted, the stable revision serves
        write("v3", sha256="0" * 64)
        hybridllm("apply", "-f", str(manifest), *state_root)
        wait_for("the rollout aborted", lambda: rollout().get("phase") == "Aborted",
                 timeout_s=180)  # fmt: skip
        wait_for("the canary gone", lambda: names_() == {"edge-0", "gateway-0"})
        message = rollout()["message"]
        assert "the pods of v3 cannot run: edge-canary-0 exited (exit code 3)" in message
        assert f"expected {'0' * 64}" in message  # its last words: why it could not load
        shown = hybridllm("rollout", "status", "canary", "--local", *state_root).stdout
        assert "Aborted" in shown, shown
        assert "stable revision: v2" in shown, shown
        assert local.process("edge-0")["pid"] == promoted["pid"]  # left alone
        answered = _revision_answers(local)
        wait_for(
            "the stable revision answers", lambda: _revision_answers(local)["v2"] > answered["v2"]
        )

        # ---- a revision that answers a golden prompt wrong: no traffic, aborted
        doc["spec"]["model"].pop("sha256")
        write("v4", contextLength=300)
        hybridllm("apply", "-f", str(manifest), *state_root)
        wait_for("the rollout of v4 aborted",
                 lambda: rollout().get("phase") == "Aborted" and rollout()["canaryRevision"] == "v4",
                 timeout_s=180)  # fmt: skip
        message = rollout()["message"]
        assert "golden prompt 2 ('Summarise this text." in message, message
        assert "answered wrong by v4 on the edge tier: expected /fox/" in message, message
        assert "v4" not in _revision_answers(local)  # not one client request reached it
        gateway_log = (root / "canary" / "logs" / "gateway-0.log").read_text()
        assert "golden prompt 2 failed" in gateway_log
        assert "HTTP 400" in gateway_log
        wait_for("the canary of v4 gone", lambda: names_() == {"edge-0", "gateway-0"})

        # ---- anything but the model and the rollout is refused, naming the field
        doc["spec"]["edge"]["pool"]["maxReplicas"] = 2
        manifest.write_text(yaml.safe_dump(doc))
        refused = hybridllm("apply", "-f", str(manifest), *state_root, check=False)
        assert refused.returncode == 2
        assert "spec.edge.pool.maxReplicas: a running local service cannot take this change" in (
            refused.stderr
        )
    finally:
        stop.set()
        asker.join(timeout=60)
        local.down()
    assert failures == [], failures[:3]
