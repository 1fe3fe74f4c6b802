"""Tool calls, as OpenAI's chat API defines them, for both runtimes: one prompt format, one
grammar, one parser.

A request's ``tools`` (functions with JSON-schema ``parameters``), ``tool_choice`` and
``parallel_tool_calls`` become three things:

- **the prompt**: when the model's chat template renders ``tools`` itself, it gets them;
  otherwise (SmolLM2's template has none) a system message in the documented format
  below is added, and the history's assistant ``tool_calls`` and ``tool`` results are
  written in the same format;
- **a grammar** (llguidance Lark, see ``structured.py``): with ``required`` or a named
  function the answer is one or more calls, each ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, the arguments generated under the function's JSON schema, so
  they always parse and validate; with ``auto`` the answer is either such calls or text
  (text that does not start with ``<``); with ``none`` there is no grammar and no tools
  in the prompt. Several calls in one answer only with ``parallel_tool_calls: true`` (the
  default is one, as llama.cpp's server has it); the arguments hold only the declared
  properties unless the schema sets ``additionalProperties``;
- **a parser** for the answer (whole, or streamed with :class:`StreamParser`): calls
  become ``tool_calls`` with ``finish_reason: "tool_calls"``.

The format (the one Hermes and Qwen models are trained on)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

and a tool's result goes back to the model as a user turn
``<tool_response>\\n...\\n</tool_response>``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridllm_common import openai_protocol as oai
from hybridllm_common.structured import JSON_OPTIONS, Constraint, lark_literal, refuse

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SCHEMA_BYTES = 64 * 1024

SYSTEM_PROMPT = """# Tools

You can call functions to answer. The functions, one JSON object each:
<tools>
{tools}
</tools>

To call functions, answer with nothing but one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments, a JSON object>}}}}
</tool_call>
The results come back in <tool_response></tool_response> blocks. Otherwise answer in text."""


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[Function, ...]
    choice: Literal["auto", "required"] | str  # or a function's name
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def _function(i: int, tool: Any) -> Function:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise refuse(f"{param}.type", 'only tools of type "function" are supported')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise refuse(f"{param}.function", "must be an object")
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise refuse(f"{param}.function.{sorted(unknown)[0]}", "unknown field")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise refuse(f"{param}.function.name", "must be 1-64 letters, digits, _ or -")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise refuse(f"{param}.function.description", "must be a string")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise refuse(f"{param}.function.parameters", "must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise refuse(f"{param}.function.parameters.type", 'the arguments must be an "object"')
    if len(json.dumps(parameters)) > MAX_SCHEMA_BYTES:
        raise refuse(f"{param}.function.parameters", f"larger than {MAX_SCHEMA_BYTES} bytes")
    return Function(name, description, parameters)


def from_request(body: oai.ChatCompletionRequest) -> ToolSpec | None:
    """The request's tools, or None (no tools, or ``tool_choice: "none"``)."""
    sent = body.model_dump(exclude_unset=True)
    tools = sent.get("tools") or []
    choice = sent.get("tool_choice")
    # One call per answer unless the client asks for more (llama.cpp's server default):
    # small models, free to add calls, repeat the first one until max_tokens.
    parallel = sent.get("parallel_tool_calls", False)
    if not isinstance(tools, list):
        raise refuse("tools", "must be a list")
    if len(tools) > MAX_TOOLS:
        raise refuse("tools", f"at most {MAX_TOOLS} tools")
    if not isinstance(parallel, bool):
        raise refuse("parallel_tool_calls", "must be a boolean")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise refuse("tools", "function names must be unique")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict):
            raise refuse(
                "tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}'
            )
        if fn.get("name") not in names:
            raise refuse(
                "tool_choice.function.name", f"{str(fn.get('name'))[:64]!r} is not in tools"
            )
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise refuse("tool_choice", 'must be "none", "auto", "required" or a named function')
    if choice == "none":
        return None
    if not functions:
        if choice == "required":
            raise refuse("tool_choice", '"required" needs at least one tool')
        return None
    return ToolSpec(functions, choice, parallel)


def constraint(spec: ToolSpec) -> Constraint:
    """The grammar of an answer under ``spec`` (see the module's docstring)."""
    chosen = [f for f in spec.functions if spec.choice in ("auto", "required", f.name)]
    rules = []
    for i, f in enumerate(chosen):
        # The arguments carry the declared properties only, unless the schema says
        # otherwise: left open, a small model fills them with copies of the schema.
        arguments = {"additionalProperties": False, **f.parameters}
        schema = {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }
        rules.append(f"f{i}: %json {json.dumps(schema)}")
    body = " | ".join(f"f{i}" for i in range(len(chosen)))
    calls = 'call ("\\n" call)*' if spec.parallel else "call"
    start = f"start: {calls}" if spec.forced else f"start: {calls} | TEXT\nTEXT: /[^<](?s:.)*/"
    source = "\n".join(
        [
            start,
            f"call: {lark_literal(OPEN + chr(10))} body {lark_literal(chr(10) + CLOSE)}",
            f"body: {body}",
            *rules,
        ]
    )
    return Constraint.lark(source, "tool_calls", "tools")


# --- the prompt ----------------------------------------------------------------------------


def _call_text(name: str, arguments: Any) -> str:
    return (
        f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"
    )


def _history_calls(i: int, calls: Any) -> list[tuple[str, Any]]:
    """An assistant message's ``tool_calls`` as (name, arguments object)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise refuse(param, "must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise refuse(f"{param}[{j}].function", 'must be {"name": ..., "arguments": "..."}')
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise refuse(f"{param}[{j}].function.arguments", "must be a JSON string")
        try:
            parsed = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise refuse(f"{param}[{j}].function.arguments", f"not valid JSON: {exc}") from exc
        out.append((fn["name"], parsed))
    return out


def chat_messages(
    messages: list[oai.ChatMessage], spec: ToolSpec | None, native: bool
) -> list[dict[str, Any]]:
    """The messages as a chat template takes them. ``native``: the template renders
    ``tools`` (and so tool turns) itself; else tool turns are written in this module's
    format and, with ``spec``, the tools go into a system message."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        extra = m.model_extra or {}
        text = m.text()
        if m.role == "assistant" and extra.get("tool_calls"):
            calls = _history_calls(i, extra["tool_calls"])
            written = "\n".join(_call_text(n, a) for n, a in calls)
            item: dict[str, Any] = {
                "role": "assistant",
                "content": (text + "\n" if text else "") + written,
            }
            if native:
                item["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls
                ]
            out.append(item)
        elif m.role == "tool":
            if native:
                out.append(
                    {"role": "tool", "content": text, "tool_call_id": extra.get("tool_call_id")}
                )
            else:
                out.append(
                    {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                )
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    if spec is not None and not native:
        listing = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in spec.functions)
        prompt = SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads ``tools`` (then it is given them, not our prompt)."""
    return bool(template) and re.search(r"\btools\b", template or "") is not None


# --- the answer ----------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the API carries it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_api(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _parse_block(block: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str, spec: ToolSpec) -> list[ToolCall] | None:
    """The calls in a whole answer, or None when it is text (or not well-formed calls)."""
    names = {f.name for f in spec.functions}
    rest = text.strip()
    if not rest.startswith(OPEN):
        return None
    calls = []
    while rest:
        if not rest.startswith(OPEN):
            return None
        end = rest.find(CLOSE)
        if end < 0:
            return None
        call = _parse_block(rest[len(OPEN) : end], names)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end + len(CLOSE) :].lstrip()
    return calls


class StreamParser:
    """Streamed text in, content deltas and finished calls out.

    Text is held back only while it could still be the start of ``<tool_call>``; once it
    cannot, it streams as content. In a call, each call is emitted whole when its closing
    tag arrives (one ``tool_calls`` delta with its id, name and arguments).
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.names = {f.name for f in spec.functions}
        self.mode: Literal["undecided", "text", "calls"] = "undecided"
        self.buffer = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        # a closing tag can only end in the new text: search from just before it (each
        # token would otherwise scan the whole call so far again)
        scan = max(0, len(self.buffer) - len(CLOSE))
        self.buffer += text
        if self.mode == "undecided":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.mode = "calls"
            elif not OPEN.startswith(head):
                self.mode = "text"
            else:
                return "", []
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return out, []
        found = []
        while True:
            end = self.buffer.find(CLOSE, scan)
            if end < 0:
                break
            scan = 0
            start = self.buffer.find(OPEN)
            call = (
                _parse_block(self.buffer[start + len(OPEN) : end], self.names)
                if 0 <= start < end
                else None
            )
            self.buffer = self.buffer[end + len(CLOSE) :]
            if call is not None:
                found.append(call)
        self.calls.extend(found)
        return "", found

    def finish(self) -> str:
        """What is left as text at the end (an unfinished call, or undecided text)."""
        out, self.buffer = self.buffer, ""
        return out if self.mode != "calls" or not self.calls else out.strip()


# --- one chat request, both runtimes -------------------------------------------------------


@dataclass
class ChatPlan:
    """What a chat request asks of a runtime beyond sampling."""

    messages: list[dict[str, Any]]  # for the chat template
    tools: list[dict[str, Any]] | None  # given to a template that renders tools itself
    spec: ToolSpec | None
    constraint: Constraint | None  # the grammar of the answer, if any


def plan_chat(body: oai.ChatCompletionRequest, template: str | None) -> ChatPlan:
    """Tools, tool choice and output format of a chat request, checked (400s name the field)."""
    from hybridllm_common import structured

    spec = from_request(body)
    fmt = structured.from_request(body)
    if spec is not None and fmt is not None:
        raise refuse(
            fmt.param, 'not supported together with tools: send one, or tool_choice "none"'
        )
    native = spec is not None and template_renders_tools(template)
    messages = chat_messages(body.messages, spec, native)
    tools = [f.as_tool() for f in spec.functions] if native and spec is not None else None
    return ChatPlan(messages, tools, spec, constraint(spec) if spec is not None else fmt)


def _api_call(call: ToolCall, index: int | None = None) -> oai.ToolCall:
    fn = oai.ToolCallFunction(name=call.name, arguments=call.arguments)
    if index is None:
        return oai.ToolCall(id=call.id, function=fn)
    return oai.ToolCallDelta(id=call.id, function=fn, index=index)


def message(
    text: str, finish_reason: str | None, spec: ToolSpec | None
) -> tuple[oai.ChatResponseMessage, str | None]:
    """A finished choice's message: its tool calls (``finish_reason: "tool_calls"``) or text."""
    calls = parse(text, spec) if spec is not None else None
    if not calls:
        return oai.ChatResponseMessage(content=text), finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return oai.ChatResponseMessage(content=None, tool_calls=[_api_call(c) for c in calls]), reason


class DeltaShaper:
    """One streamed choice: new text in, the chunk's delta and finish reason out."""

    def __init__(self, spec: ToolSpec | None) -> None:
        self.parser = StreamParser(spec) if spec is not None else None
        self.num_calls = 0

    def __call__(
        self, new_text: str, finish_reason: str | None
    ) -> tuple[oai.ChatDelta, str | None]:
        if self.parser is None:
            return oai.ChatDelta(content=new_text), finish_reason
        content, calls = self.parser.feed(new_text)
        if finish_reason is not None:
            content += self.parser.finish()
        deltas = [_api_call(c, self.num_calls + i) for i, c in enumerate(calls)]
        self.num_calls += len(calls)
        if finish_reason == "stop" and self.num_calls:
            finish_reason = "tool_calls"
        quiet = deltas or self.parser.mode == "calls"  # a call's text is not content
        delta = oai.ChatDelta(content=content if content or not quiet else None)
        if deltas:
            delta.tool_calls = deltas  # type: ignore[assignment]
        return delta, finish_reason
