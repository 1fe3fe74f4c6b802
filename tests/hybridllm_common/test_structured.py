"""Structured output and tool calls, the part both runtimes share: requests to grammars
(with 400s naming the field), grammars to token masks on the real model's vocabulary, and
model answers back to tool calls."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from hybridllm_common import openai_protocol as oai
from hybridllm_common import structured, tool_calls

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "structured-schemas.json").read_text())
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                    "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "description": "Look up a word",
     "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                    "required": ["word"]}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def vocab() -> structured.Vocabulary:
    """SmolLM2's vocabulary, from the model store's tokenizer.json."""
    import hybridllm_models

    hf = Path(hybridllm_models.ensure())
    return structured.Vocabulary.from_tokenizer_json(
        (hf / "tokenizer.json").read_text(), 49152, [2]
    )


def _chat(**fields: object) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


def _walk(vocab: structured.Vocabulary, constraint: structured.Constraint, text: str) -> bool:
    """Whether the grammar lets the tokens of ``text`` through, one masked step at a time,
    and then allows the end of the sequence."""
    m = vocab.matcher(constraint)
    for token in vocab.tokenizer.tokenize_str(text):
        if not m.allowed()[token] or not m.accept(token):
            return False
    return bool(m.allowed()[2])


def test_every_corpus_schema_compiles_and_masks_to_valid_json_only(
    vocab: structured.Vocabulary,
) -> None:
    """The corpus the end-to-end tests generate under: every schema compiles for the real
    vocabulary, a matcher walks a valid compact instance to its end, and refuses text that
    breaks the schema (a wrong type) before the end."""
    assert len(CORPUS["schemas"]) >= 50
    instances = {
        "person": {"name": "Ana", "age": 31},
        "tags": {"tags": ["food", "tea"]},
        "anyof": {"id": "ABC"},
        "nullable": {"first": "John", "middle": None},
        "ref": {"from": {"x": 1, "y": 2}, "to": {"x": -3, "y": 4}},
        "date": {"date": "1969-07-20"},
        "pattern_code": {"code": "AB-1234"},
        "array_top": ["red", "blue"],
    }
    for entry in CORPUS["schemas"]:
        body = _chat(response_format={"type": "json_schema",
                     "json_schema": {"name": entry["name"], "schema": entry["schema"]}})  # fmt: skip
        c = structured.from_request(body)
        assert c is not None
        assert c.kind == "json_schema"
        vocab.check(c)
        if entry["name"] in instances:
            good = instances[entry["name"]]
            jsonschema.validate(good, entry["schema"])
            assert _walk(vocab, c, json.dumps(good)), entry["name"]
            bad = json.dumps(good).replace('"', "'", 2)
            assert not _walk(vocab, c, bad), entry["name"]


def test_vllm_fields_and_json_object_each_give_their_grammar(vocab: structured.Vocabulary) -> None:
    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object", '{"a": [1, true]}', "[1]"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", "no", "maybe"),
        ({"guided_choice": ["yes", "no"]}, "choice", "yes", "yes!"),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, "regex", "1969", "19a9"),
        ({"guided_regex": "[a-z]+@[a-z]+\\.com"}, "regex", "a@b.com", "a@b"),
        ({"guided_json": '{"type": "integer"}'}, "json_schema", "42", "4.2"),
        ({"structured_outputs": {"json": {"type": "boolean"}}}, "json_schema", "true", "1"),
        ({"guided_grammar": 'root ::= "a" ("," "a")*'}, "grammar", "a,a", "a,,a"),
        ({"structured_outputs": {"grammar": 'start: "x"+'}}, "grammar", "xxx", "xy"),
    ]
    for fields, kind, good, bad in cases:
        c = structured.from_request(_chat(**fields))
        assert c is not None, fields
        assert c.kind == kind, fields
        vocab.check(c)
        assert _walk(vocab, c, good), (fields, good)
        assert not _walk(vocab, c, bad), (fields, bad)
    assert structured.from_request(_chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type", "not one of"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"type": "string", "pattern": "(a"}}}},
         "response_format.json_schema.schema", "unclosed group"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {"$ref": "#/nope"}}}}, "response_format.json_schema.schema", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
          "schema": {}, "extra": 1}}}, "response_format.json_schema.extra", "unknown"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "not several"),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern", "not supported"),
        ({"structured_outputs": {"choice": ["a"], "backend": "xgrammar"}},
         "structured_outputs.backend", "only llguidance"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend",
         "only llguidance"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "conflicts with response_format"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", ""),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format",
         "together with tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", "letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(
    vocab: structured.Vocabulary, fields: dict[str, object], param: str, words: str
) -> None:
    body = _chat(**fields)

    def admit() -> None:
        plan = tool_calls.plan_chat(body, None)
        if plan.constraint is not None:
            vocab.check(plan.constraint)

    with pytest.raises(oai.APIError) as caught:
        admit()
    assert caught.value.code == oai.INVALID_PARAMETER
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")
    assert words in caught.value.message


def test_tool_choice_shapes_the_grammar_the_prompt_and_the_answer(
    vocab: structured.Vocabulary,
) -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    second = '<tool_call>\n{"name": "lookup", "arguments": {"word": "x"}}\n</tool_call>'
    required = tool_calls.plan_chat(_chat(tools=TOOLS, tool_choice="required"), None)
    assert required.constraint is not None
    assert required.spec is not None
    assert _walk(vocab, required.constraint, call)
    assert not _walk(vocab, required.constraint, "The answer is 5.")
    assert not _walk(vocab, required.constraint, call + "\n" + second)  # one call by default
    assert not _walk(vocab, required.constraint, call.replace('"b": 3', '"b": 3, "c": 1'))
    parallel = tool_calls.plan_chat(_chat(tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=True), None)  # fmt: skip
    assert parallel.constraint is not None
    assert _walk(vocab, parallel.constraint, call + "\n" + second)
    named = tool_calls.plan_chat(_chat(tools=TOOLS, tool_choice={"type": "function",
                                       "function": {"name": "lookup"}}), None)  # fmt: skip
    assert named.constraint is not None
    assert _walk(vocab, named.constraint, second)
    assert not _walk(vocab, named.constraint, call)
    auto = tool_calls.plan_chat(_chat(tools=TOOLS), None)
    assert auto.constraint is not None
    assert _walk(vocab, auto.constraint, call)
    assert _walk(vocab, auto.constraint, "It is 5.")
    none = tool_calls.plan_chat(_chat(tools=TOOLS, tool_choice="none"), None)
    assert none.constraint is None
    assert none.spec is None
    assert "<tools>" not in json.dumps(none.messages)
    # the tools go to the model in a system message (SmolLM2's template renders none) ...
    assert required.messages[0]["role"] == "system"
    assert '"name": "lookup"' in required.messages[0]["content"]
    # ... unless the template renders them itself
    native = tool_calls.plan_chat(_chat(tools=TOOLS), "{% for t in tools %}{{ t }}{% endfor %}")
    assert native.tools is not None
    assert native.messages == [{"role": "user", "content": "hi"}]
    # the answer: calls with their arguments as JSON text, finish_reason tool_calls
    message, reason = tool_calls.message(call, "stop", required.spec)
    assert reason == "tool_calls"
    assert message.content is None
    assert message.tool_calls
    assert message.tool_calls[0].function.name == "add"
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    text, reason = tool_calls.message("It is 5.", "stop", auto.spec)
    assert (text.content, text.tool_calls, reason) == ("It is 5.", None, "stop")
    cut, reason = tool_calls.message(call[:30], "length", required.spec)
    assert (cut.content, reason) == (call[:30], "length")


def test_a_streamed_answer_gives_the_same_calls_wherever_the_chunks_split() -> None:
    spec = tool_calls.from_request(_chat(tools=TOOLS, parallel_tool_calls=True))
    assert spec is not None
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    text = call + "\n" + call.replace("add", "lookup").replace('{"a": 2, "b": 3}', '{"word": "y"}')
    for cut in range(1, len(text)):
        shaper = tool_calls.DeltaShaper(spec)
        first, _ = shaper(text[:cut], None)
        last, reason = shaper(text[cut:], "stop")
        deltas = (first.tool_calls or []) + (last.tool_calls or [])
        assert [(d.index, d.function.name) for d in deltas] == [(0, "add"), (1, "lookup")]
        assert reason == "tool_calls"
        assert not first.content
        assert not last.content
    shaper = tool_calls.DeltaShaper(spec)
    held, _ = shaper("<to", None)
    assert held.content == ""  # could still be a call: held back
    out, reason = shaper("day it rains", "stop")
    assert (out.content, reason) == ("<today it rains", "stop")


def test_history_with_tool_calls_and_results_is_written_in_the_prompt_format() -> None:
    body = oai.ChatCompletionRequest.model_validate({
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
        "tools": TOOLS,
    })  # fmt: skip
    plan = tool_calls.plan_chat(body, None)
    roles = [m["role"] for m in plan.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert plan.messages[2]["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    assert plan.messages[3]["content"] == "<tool_response>\n5\n</tool_response>"
    bad = body.model_dump()
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(oai.APIError) as caught:
        tool_calls.plan_chat(oai.ChatCompletionRequest.model_validate(bad), None)
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"


def test_a_batch_of_masks_is_each_sequence_s_own(vocab: structured.Vocabulary) -> None:
    """The cloud engine makes a step's masks in one call (``allowed_batch``): each row is
    what that sequence's matcher allows alone, at its own place in its own grammar."""
    import numpy as np

    digits = structured.Constraint.regex(r"[0-9]{3}", "regex")
    json_object = structured.from_request(_chat(response_format={"type": "json_object"}))
    assert json_object is not None
    matchers = [vocab.matcher(c) for c in (digits, json_object, digits)]
    for token in vocab.tokenizer.tokenize_str("123"):
        assert matchers[2].accept(token)  # the third at its end; the others at the start
    batch = structured.allowed_batch(matchers)
    assert batch.shape == (3, vocab.vocab_size)
    for row, m in zip(batch, matchers, strict=True):
        assert np.array_equal(row, m.allowed())
    assert batch[0][vocab.tokenizer.tokenize_str("7")[0]]  # a digit may start
    assert batch[2].sum() == 1  # after three digits only the end of the sequence is left
    assert batch[2][2]
