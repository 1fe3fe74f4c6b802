"""The admission checks both runtimes share: one set of refusals, named parameters."""

from __future__ import annotations

import pytest

from hybridllm_common import admission
from hybridllm_common import openai_protocol as oai


def _chat(**fields: object) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"made_up": True}, "made_up"),
    ],
)
def test_refused_parameters_are_named(fields: dict[str, object], param: str) -> None:
    with pytest.raises(oai.APIError) as caught:
        admission.refuse_unsupported(_chat(**fields))
    assert caught.value.code == oai.INVALID_PARAMETER
    assert caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")


def test_no_op_values_and_implemented_extensions_pass() -> None:
    admission.refuse_unsupported(
        _chat(
            presence_penalty=1.5,
            frequency_penalty=-0.5,
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            best_of=1,
            cache=True,
            cache_salt="tenant-a",
            seed=3,
            stop=["\n"],
        )
    )
    completion = oai.CompletionRequest.model_validate({"prompt": "x", "suffix": ""})
    admission.refuse_unsupported(completion)
    with pytest.raises(oai.APIError, match="tools: tool calls are served on /v1/chat"):
        admission.refuse_unsupported(
            oai.CompletionRequest.model_validate({"prompt": "x", "tools": [{"type": "function"}]})
        )
    with pytest.raises(oai.APIError, match="suffix: not supported yet"):
        admission.refuse_unsupported(
            oai.CompletionRequest.model_validate({"prompt": "x", "suffix": "y"})
        )


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    assert admission.prompt_token_ids([0, 5, 9], 10) == [0, 5, 9]
    for bad in (10, -1):
        with pytest.raises(
            oai.APIError, match=rf"token id {bad} is outside the vocabulary \[0, 10\)"
        ):
            admission.prompt_token_ids([1, bad], 10)


def test_max_new_tokens_fills_the_context_or_names_what_does_not_fit() -> None:
    assert admission.max_new_tokens(_chat(), 10, 64) == 54
    assert admission.max_new_tokens(_chat(max_tokens=5), 10, 64) == 5
    with pytest.raises(oai.APIError) as caught:
        admission.max_new_tokens(_chat(max_tokens=60), 10, 64)
    assert caught.value.code == oai.CONTEXT_LENGTH_EXCEEDED
    assert caught.value.param == "max_tokens"
    with pytest.raises(oai.APIError, match="exceeds the context length 64"):
        admission.max_new_tokens(_chat(), 64, 64)
    with pytest.raises(oai.APIError, match="stop_token_ids"):
        admission.max_new_tokens(_chat(stop_token_ids=[-3]), 3, 64)
