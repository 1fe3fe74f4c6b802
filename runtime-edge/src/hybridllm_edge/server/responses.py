"""OpenAI response and stream-chunk shapes from engine outputs (mixed into ``Serving``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hybridllm_common import openai_protocol as oai
from hybridllm_common import tool_calls
from hybridllm_edge import engine, sampling

Body = oai.ChatCompletionRequest | oai.CompletionRequest


@dataclass
class ChoiceState:
    pieces: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, sampling.Choice]] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    logprob_sum: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in the slot's KV (the prompt cache)


class ResponseShapes:
    app: Any
    engine: engine.Engine
    tool_spec: tool_calls.ToolSpec | None
    shapers: dict[int, tool_calls.DeltaShaper]

    def _detok(self, ids: list[int]) -> str:
        raw = b"".join(self.engine.backend.token_bytes(t) for t in ids)
        return raw.decode("utf-8", "replace")

    def _usage(self, prompt: list[int], choices: list[ChoiceState]) -> oai.Usage:
        completion = sum(c.num_tokens for c in choices)
        total_lp = sum(c.logprob_sum for c in choices)
        return oai.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion,
            total_tokens=len(prompt) + completion,
            # OpenAI's field: of the prompt, the tokens served from the prompt cache (every
            # choice's, when n > 1 ran each in a slot of its own)
            prompt_tokens_details={"cached_tokens": min(c.cached_tokens for c in choices)},
            mean_logprob=total_lp / completion if completion else None,
        )

    def _token_str(self, token_id: int) -> str:
        return self.engine.backend.token_bytes(token_id).decode("utf-8", "replace")

    def _chat_logprobs(self, lps: list[tuple[int, sampling.Choice]]) -> oai.ChoiceLogprobs:
        return oai.ChoiceLogprobs(
            content=[
                oai.TokenLogprob(
                    token=self._token_str(t),
                    logprob=lp.logprob,
                    top_logprobs=[
                        oai.TopLogprob(token=self._token_str(a), logprob=v)
                        for a, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                )
                for t, lp in lps
            ]
        )

    def _completion_logprobs(
        self, lps: list[tuple[int, sampling.Choice]]
    ) -> oai.CompletionLogprobs:
        out = oai.CompletionLogprobs()
        offset = 0
        for t, lp in lps:
            text = self._token_str(t)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(
                {
                    self._token_str(a): v
                    for a, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _full_response(
        self, body: Body, rid: str, choices: list[ChoiceState], usage: oai.Usage, echo: str
    ) -> oai.ChatCompletionResponse | oai.CompletionResponse:
        model = self.app.state.model_name
        if isinstance(body, oai.ChatCompletionRequest):
            return oai.ChatCompletionResponse(
                id=rid,
                model=model,
                usage=usage,
                choices=[self._chat_choice(body, i, c) for i, c in enumerate(choices)],
            )
        return oai.CompletionResponse(
            id=rid,
            model=model,
            usage=usage,
            choices=[
                oai.CompletionChoice(
                    index=i,
                    text=echo + "".join(c.pieces),
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                    logprobs=self._completion_logprobs(c.logprobs)
                    if body.logprobs is not None
                    else None,
                )
                for i, c in enumerate(choices)
            ],
        )

    def _chat_choice(
        self, body: oai.ChatCompletionRequest, i: int, c: ChoiceState
    ) -> oai.ChatChoice:
        message, reason = tool_calls.message("".join(c.pieces), c.finish_reason, self.tool_spec)
        return oai.ChatChoice(
            index=i,
            message=message,
            finish_reason=reason,  # type: ignore[arg-type]
            logprobs=self._chat_logprobs(c.logprobs) if body.logprobs else None,
        )

    def _chunk(
        self,
        body: Body,
        rid: str,
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        lps: list[tuple[int, sampling.Choice]] | None,
    ) -> str:
        model = self.app.state.model_name
        obj: oai.ChatCompletionChunk | oai.CompletionResponse
        if isinstance(body, oai.ChatCompletionRequest):
            shaper = self.shapers.setdefault(index, tool_calls.DeltaShaper(self.tool_spec))
            delta, finish_reason = shaper(text, finish_reason)
            if first:
                delta.role = "assistant"
            lp = self._chat_logprobs(lps) if lps is not None and body.logprobs else None
            choice = oai.ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish_reason, logprobs=lp
            )  # type: ignore[arg-type]
            obj = oai.ChatCompletionChunk(id=rid, model=model, choices=[choice])
        else:
            lp2 = (
                self._completion_logprobs(lps)
                if lps is not None and body.logprobs is not None
                else None
            )
            cc = oai.CompletionChoice(
                index=index, text=text, finish_reason=finish_reason, logprobs=lp2
            )  # type: ignore[arg-type]
            obj = oai.CompletionResponse(id=rid, model=model, choices=[cc])
        return f"data: {json.dumps(obj.model_dump(exclude_none=True))}\n\n"

    def _usage_chunk(self, body: Body, rid: str, usage: oai.Usage) -> str:
        model = self.app.state.model_name
        obj: oai.ChatCompletionChunk | oai.CompletionResponse
        if isinstance(body, oai.ChatCompletionRequest):
            obj = oai.ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage)
        else:
            obj = oai.CompletionResponse(id=rid, model=model, choices=[], usage=usage)
        return f"data: {json.dumps(obj.model_dump(exclude_none=True) | {'choices': []})}\n\n"
