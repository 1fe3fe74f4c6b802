"""Structured output: what a request says its answer must match, compiled to a grammar, and
the matcher that masks every decoding step to it. One implementation for both runtimes.

A request asks with OpenAI's ``response_format`` (``json_object``, ``json_schema``) or with
vLLM's extensions, so clients written for vLLM work unchanged: ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. Tool calls (``tool_calls.py``) build
their grammar here too.

The grammars are llguidance's (JSON Schema, regular expressions, a Lark-like CFG; GBNF is
converted), the library llama.cpp and vLLM use for this. It was chosen over xgrammar for
three measured reasons (docs/structured-output.md): a mask for the 49,152-token SmolLM2
vocabulary in a median 21 us on this machine's CPU, no compile step per schema worth
caching (0.41 ms for a matcher; bench/results/structured.md), and no dependency beyond one wheel, which matters on the
edge runtime, where torch is not installed. Its compile and match work is bounded by
llguidance's parser limits (fuel per token and per grammar), so a hostile schema or regex
fails its own request, never the step loop.

A runtime builds one :class:`Vocabulary` when it loads its model, turns a request into a
:class:`Constraint` with :func:`from_request` (a 400 naming the field for anything wrong or
unsupported), and gives each generated sequence a :class:`Matcher`: before each sample the
matcher's :meth:`Matcher.allowed` mask removes every token that cannot continue a valid
answer, after it :meth:`Matcher.accept` advances, and :attr:`Matcher.done` ends the
sequence once the grammar can take nothing more.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from hybridllm_common import openai_protocol as oai

# Request fields (vLLM's names) that ask for structured output besides response_format.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELD = "structured_outputs"
EXTRA_FIELDS = frozenset({STRUCTURED_FIELD, *GUIDED_FIELDS, "guided_decoding_backend"})
# structured_outputs keys (vLLM's StructuredOutputsParams) and what each is.
_SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# vLLM backends a client may name: "auto" and llguidance's name mean the one used here.
_BACKENDS = frozenset({"auto", "guidance", "llguidance"})
MAX_CHOICES = 256
# JSON is generated compact, with one space after "," and ":" (what json.dumps writes):
# flexible whitespace lets a small model pad an answer with newlines and indentation
# until it runs out of tokens. A schema may override this with llguidance's "x-guidance".
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def refuse(param: str, message: str) -> oai.APIError:
    """A 400 `invalid_parameter` naming ``param`` (the message starts with it)."""
    return oai.APIError(oai.INVALID_PARAMETER, f"{param}: {message}", param)


@dataclass(frozen=True)
class Constraint:
    """A compiled-to-text grammar (llguidance's serialized form) and what asked for it."""

    kind: str  # json_object | json_schema | regex | choice | grammar | tool_calls
    grammar: str
    param: str  # the request field it came from, for errors

    @staticmethod
    def json_schema(
        schema: dict[str, Any] | bool, param: str, kind: str = "json_schema"
    ) -> Constraint:
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise refuse(param, "a JSON schema must be an object")
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise refuse(param, f"not a usable JSON schema: {exc}") from exc
        return Constraint(kind, grammar, param)

    @staticmethod
    def regex(pattern: str, param: str) -> Constraint:
        return Constraint("regex", LLMatcher.grammar_from_regex(pattern), param)

    @staticmethod
    def lark(source: str, kind: str, param: str) -> Constraint:
        return Constraint(kind, LLMatcher.grammar_from_lark(source), param)


def lark_literal(text: str) -> str:
    """A Lark string literal matching ``text`` exactly (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _choice(choices: Any, param: str) -> Constraint:
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise refuse(param, "must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise refuse(param, f"at most {MAX_CHOICES} choices")
    alternatives = " | ".join(lark_literal(c) for c in dict.fromkeys(choices))
    return Constraint.lark(f"start: {alternatives}\n", "choice", param)


def _grammar(source: Any, param: str) -> Constraint:
    if not isinstance(source, str) or not source.strip():
        raise refuse(param, "must be a non-empty grammar (Lark, or GBNF with ::= rules)")
    if "::=" in source:  # GBNF, as llama.cpp and xgrammar take it
        try:
            source = any_to_lark(source)
        except Exception as exc:  # the converter raises plain exceptions on bad input
            raise refuse(param, f"not a valid GBNF grammar: {exc}") from exc
    return Constraint.lark(source, "grammar", param)


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise refuse(param, 'must be an object with a "type"')
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema({"type": "object"}, param, "json_object")
    if kind != "json_schema":
        raise refuse(
            f"{param}.type", f"{str(kind)[:40]!r} is not one of text, json_object, json_schema"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise refuse(f"{param}.json_schema", 'must be an object with a "name" and a "schema"')
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise refuse(f"{param}.json_schema.{sorted(unknown)[0]}", "unknown field")
    if "schema" not in spec:
        # OpenAI's default: any JSON object.
        return Constraint.json_schema({"type": "object"}, param, "json_object")
    return Constraint.json_schema(spec["schema"], f"{param}.json_schema.schema")


def _structured_outputs(value: Any) -> Constraint | None:
    param = STRUCTURED_FIELD
    if not isinstance(value, dict):
        raise refuse(param, "must be an object")
    backend = value.get("backend")
    if backend is not None and backend not in _BACKENDS:
        raise refuse(
            f"{param}.backend", f"{str(backend)[:40]!r}: only llguidance is available here"
        )
    allowed = {*_SO_KINDS, "json_object", "backend"}
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise refuse(f"{param}.{unknown[0]}", "not supported (json, regex, choice, grammar and "
                   "json_object are)")  # fmt: skip
    asked = [k for k in (*_SO_KINDS, "json_object") if value.get(k) not in (None, False)]
    if len(asked) > 1:
        raise refuse(param, f"give one of {', '.join(asked)}, not several")
    if not asked:
        return None
    key = asked[0]
    return _one(key if key != "json_object" else "json_object", value[key], f"{param}.{key}")


def _one(key: str, value: Any, param: str) -> Constraint:
    if key in ("json", "guided_json"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise refuse(param, f"not valid JSON: {exc}") from exc
        return Constraint.json_schema(value, param)
    if key in ("regex", "guided_regex"):
        if not isinstance(value, str) or not value:
            raise refuse(param, "must be a non-empty regular expression")
        return Constraint.regex(value, param)
    if key in ("choice", "guided_choice"):
        return _choice(value, param)
    if key in ("grammar", "guided_grammar"):
        return _grammar(value, param)
    if key == "json_object":
        if value is not True:
            raise refuse(param, "must be true")
        return Constraint.json_schema({"type": "object"}, param, "json_object")
    raise refuse(param, "unknown structured output")  # pragma: no cover - keys are fixed above


def from_request(body: oai.ChatCompletionRequest | oai.CompletionRequest) -> Constraint | None:
    """The request's output constraint, or None. A 400 names a malformed or conflicting field.

    The grammar is not checked against a vocabulary here: :meth:`Vocabulary.check` does,
    in the runtime that will decode it.
    """
    extras = body.model_extra or {}
    found: list[Constraint] = []
    sent = body.model_dump(exclude_unset=True)
    if sent.get("response_format") is not None:
        c = _response_format(sent["response_format"])
        if c is not None:
            found.append(c)
    if extras.get(STRUCTURED_FIELD) is not None:
        c = _structured_outputs(extras[STRUCTURED_FIELD])
        if c is not None:
            found.append(c)
    for name in GUIDED_FIELDS:
        if extras.get(name) is not None:
            found.append(_one(name, extras[name], name))
    backend = extras.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise refuse(
            "guided_decoding_backend", f"{str(backend)[:40]!r}: only llguidance is available here"
        )
    if len(found) > 1:
        raise refuse(found[1].param, f"conflicts with {found[0].param}: ask for one output format")
    return found[0] if found else None


class Vocabulary:
    """The model's tokens as llguidance sees them (built once per loaded model, ~0.2 s)."""

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # logits width (may exceed the tokenizer's)

    @classmethod
    def from_tokenizer_json(
        cls, text: str, vocab_size: int, eos_token_ids: list[int]
    ) -> Vocabulary:
        """From a Hugging Face ``tokenizer.json`` (the cloud runtime, the edge's ONNX path)."""
        return cls(LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_ids), vocab_size)

    def check(self, constraint: Constraint) -> None:
        """A 400 naming the field when the grammar does not compile for this vocabulary
        (a schema feature llguidance refuses, a bad regex, a grammar that cannot parse)."""
        error = LLMatcher.validate_grammar(constraint.grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise refuse(constraint.param, error.strip().replace("\n", " ")[:500])

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self, constraint)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, vocab: Vocabulary, constraint: Constraint) -> None:
        self.vocab = vocab
        self.constraint = constraint
        self._m = LLMatcher(vocab.tokenizer, constraint.grammar, log_level=0)
        if self._m.is_error():
            raise refuse(constraint.param, self._m.get_error()[:500])
        self._words = np.zeros((1, (vocab.vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """Which tokens may come next: bool[vocab_size]."""
        llguidance.numpy.fill_next_token_bitmask(self._m, self._words, 0)
        bits = np.unpackbits(self._words[0].view(np.uint8), bitorder="little")
        return bits[: self.vocab.vocab_size].astype(bool)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar refused it (then the
        sequence must end: the matcher stays in its error state)."""
        return bool(self._m.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar can take nothing more (it consumed an end of sequence, or reached the
        end of a grammar that has no continuation)."""
        return bool(self._m.is_stopped())


_EXECUTOR: Any = None


def allowed_batch(matchers: list[Matcher]) -> np.ndarray:
    """Which tokens may come next, for several sequences at once: bool[len, vocab_size].
    One llguidance call fills every sequence's bit mask (in parallel where it has threads),
    and one numpy call unpacks them: a batch step pays that once, not once per row."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = LLExecutor()
    vocab = matchers[0].vocab.vocab_size
    words = np.zeros((len(matchers), (vocab + 31) // 32), dtype=np.int32)
    llguidance.numpy.fill_next_token_bitmask_par(
        _EXECUTOR, [(m._m, i) for i, m in enumerate(matchers)], words
    )
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


async def matchers(
    vocabulary: Callable[[], Vocabulary], constraint: Constraint, count: int
) -> list[Matcher]:
    """``count`` matchers of ``constraint``, for the sequences of one request: the grammar
    checked (a 400 naming the field) and compiled off the event loop and off the runtime's
    step loop (a large schema takes milliseconds). ``vocabulary`` gives the model's, built
    at the first call (~0.2 s)."""

    def build() -> list[Matcher]:
        vocab = vocabulary()
        vocab.check(constraint)
        return [vocab.matcher(constraint) for _ in range(count)]

    return await asyncio.to_thread(build)


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` with every disallowed token at -inf (a copy; numpy, one row)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    out[: allowed.shape[0]][~allowed] = -np.inf
    out[allowed.shape[0] :] = -np.inf
    return out
