"""Request admission shared by the cloud and edge runtimes: one set of checks, one set of words.

Both runtimes serve the same OpenAI surface, so what they accept must not drift apart:
every parameter a client sends is either implemented by both tiers or refused with a 400
that names it and says it is not supported yet (never accepted and silently ignored). A
parameter at its no-op value (``presence_penalty: 0``, ``tools: []``,
``response_format: {"type": "text"}``) is accepted, since SDKs send those by default.

The checks raise :class:`hybridllm_common.openai_protocol.APIError`; each server renders it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridllm_common import openai_protocol as oai
from hybridllm_common import structured

Body = oai.ChatCompletionRequest | oai.CompletionRequest

# Extension fields a runtime reads from the body besides the declared ones: the edge's
# response cache switch, vLLM's structured-output fields (structured.py) and the chat
# tool fields (tool_calls.py, read from the extras of a chat request).
KNOWN_EXTRAS = frozenset(
    {"cache", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
    | structured.EXTRA_FIELDS
)
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


def _is_noop(name: str, value: Any) -> bool:
    if value is None or value is False or value == [] or value == {} or value == "":
        return True
    if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
        return True
    if name == "tool_choice" and value == "none":
        return True
    if name == "length_penalty" and value == 1:
        return True
    return name == "best_of" and value == 1


# OpenAI parameters neither runtime implements yet, refused unless at their no-op value.
NOT_SUPPORTED_YET = (
    "suffix",
    # the pre-tools function calling API, replaced by tools / tool_choice
    "functions",
    "function_call",
    "logit_bias",
    "best_of",
    "metadata",
    "store",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    # vLLM's beam-search extensions (the cloud runtime implements them; see its serving).
    "use_beam_search",
    "length_penalty",
    "early_stopping",
)


def refuse_unsupported(body: Body, supported: frozenset[str] = frozenset()) -> None:
    """400 for a parameter that would change the answer and that nothing implements.

    ``supported``: names of ``NOT_SUPPORTED_YET`` that the calling runtime implements (and
    checks itself); the other runtime keeps refusing them.
    """
    sent = body.model_dump(exclude_unset=True)
    for name in NOT_SUPPORTED_YET:
        if name in supported:
            continue
        if name in sent and not _is_noop(name, sent[name]):
            raise oai.APIError(
                oai.INVALID_PARAMETER, f"{name}: not supported yet by this server", name
            )
    if isinstance(body, oai.CompletionRequest):
        for name in CHAT_ONLY:
            if name in sent and not _is_noop(name, sent[name]):
                raise oai.APIError(
                    oai.INVALID_PARAMETER,
                    f"{name}: tool calls are served on /v1/chat/completions",
                    name,
                )
    for name in body.model_extra or {}:
        if name not in KNOWN_EXTRAS and name not in NOT_SUPPORTED_YET:
            raise oai.APIError(oai.INVALID_PARAMETER, f"{name}: unknown parameter", name)


def prompt_token_ids(prompt: Sequence[Any], vocab_size: int) -> list[int]:
    """A token-id prompt, each id checked against the vocabulary."""
    ids = [int(t) for t in prompt]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise oai.APIError(
            oai.INVALID_PARAMETER,
            f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})",
            "prompt",
        )
    return ids


def max_new_tokens(body: Body, prompt_len: int, max_len: int) -> int:
    """The number of tokens to generate, or a 400 when the prompt does not leave room."""
    where = "messages" if isinstance(body, oai.ChatCompletionRequest) else "prompt"
    if prompt_len == 0:
        raise oai.APIError(oai.INVALID_PARAMETER, f"{where}: the prompt is empty", where)
    if prompt_len >= max_len:
        raise oai.APIError(
            oai.CONTEXT_LENGTH_EXCEEDED,
            f"prompt of {prompt_len} tokens exceeds the context length {max_len}",
            where,
        )
    max_tokens = body.effective_max_tokens()
    if max_tokens is not None and prompt_len + max_tokens > max_len:
        raise oai.APIError(
            oai.CONTEXT_LENGTH_EXCEEDED,
            f"prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the context "
            f"length {max_len}",
            "max_tokens",
        )
    if body.top_k is not None and body.top_k < 0:
        raise oai.APIError(oai.INVALID_PARAMETER, "top_k: must be >= 0", "top_k")
    if body.stop_token_ids and any(t < 0 for t in body.stop_token_ids):
        raise oai.APIError(
            oai.INVALID_PARAMETER, "stop_token_ids: token ids must be >= 0", "stop_token_ids"
        )
    return max_tokens or max_len - prompt_len
