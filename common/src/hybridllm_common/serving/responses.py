"""The response half of serving a completion, the same in both runtimes: OpenAI answers and
SSE chunks from the engines' outputs.

An answer is shaped by :class:`Shapes`, made for one request: the whole answer, each
streamed chunk (chat deltas through ``tool_calls.DeltaShaper``, so tool calls stream as
OpenAI streams them), and the usage chunk. A stream is answered only after its first
chunk (:func:`stream_response`), so a failure at admission is an HTTP error rather than a
broken stream. Token strings come from the runtime (``token_str``): the cloud's
tokenizer, the edge's token bytes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridllm_common import openai_protocol as oai
from hybridllm_common import tool_calls

Body = oai.ChatCompletionRequest | oai.CompletionRequest
DONE = "data: [DONE]\n\n"


class Logprob(Protocol):
    """A sampled token's logprob and its top alternatives, as both engines report it."""

    @property
    def logprob(self) -> float: ...
    @property
    def top_token_ids(self) -> Sequence[int]: ...
    @property
    def top_logprobs(self) -> Sequence[float]: ...


TokenLogprobs = Sequence[tuple[int, Any]]  # (token id, its Logprob)


@dataclass(frozen=True)
class Final:
    """A finished choice: its text, why it ended, and its tokens' logprobs."""

    text: str
    finish_reason: str | None
    logprobs: TokenLogprobs = ()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj.model_dump(exclude_none=True))}\n\n"


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    mean_logprob: float | None = None,
) -> oai.Usage:
    """OpenAI's usage; ``cached_tokens``: of the prompt, the tokens found in the KV cache."""
    return oai.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached_tokens},
        mean_logprob=mean_logprob,
    )


def chat_logprobs(lps: TokenLogprobs, token_str: Callable[[int], str]) -> oai.ChoiceLogprobs:
    return oai.ChoiceLogprobs(
        content=[
            oai.TokenLogprob(
                token=token_str(token_id),
                logprob=lp.logprob,
                top_logprobs=[
                    oai.TopLogprob(token=token_str(t), logprob=v)
                    for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                ],
            )
            for token_id, lp in lps
        ]
    )


def completion_logprobs(
    lps: TokenLogprobs, token_str: Callable[[int], str]
) -> oai.CompletionLogprobs:
    out = oai.CompletionLogprobs()
    offset = 0
    for token_id, lp in lps:
        text = token_str(token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(
            {token_str(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


class Shapes:
    """The answer to one request, in its endpoint's shapes (chat or text completion).

    ``spec``: the chat request's tools, whose calls are parsed out of the text.
    """

    def __init__(
        self,
        body: Body,
        model: str,
        token_str: Callable[[int], str],
        spec: tool_calls.ToolSpec | None = None,
    ) -> None:
        self.body = body
        self.model = model
        self.token_str = token_str
        self.spec = spec
        self.chat = isinstance(body, oai.ChatCompletionRequest)
        self.shapers: dict[int, tool_calls.DeltaShaper] = {}  # per streamed choice

    @property
    def wants_logprobs(self) -> bool:
        if isinstance(self.body, oai.ChatCompletionRequest):
            return self.body.logprobs is True
        return self.body.logprobs is not None

    def response(
        self,
        rid: str,
        finals: Sequence[Final],
        usage: oai.Usage,
        echo: str = "",
        headers: dict[str, str] | None = None,
    ) -> Response:
        """The whole answer (non-streaming); ``echo`` goes before each completion's text."""
        resp = self.full(rid, finals, usage, echo)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    def full(
        self, rid: str, finals: Sequence[Final], usage: oai.Usage, echo: str = ""
    ) -> oai.ChatCompletionResponse | oai.CompletionResponse:
        if self.chat:
            chat: list[oai.ChatChoice] = []
            for i, f in enumerate(finals):
                message, reason = tool_calls.message(f.text, f.finish_reason, self.spec)
                lp = chat_logprobs(f.logprobs, self.token_str) if self.wants_logprobs else None
                chat.append(
                    oai.ChatChoice(
                        index=i,
                        message=message,
                        finish_reason=reason,
                        logprobs=lp,
                    )
                )
            return oai.ChatCompletionResponse(id=rid, model=self.model, usage=usage, choices=chat)
        return oai.CompletionResponse(
            id=rid,
            model=self.model,
            usage=usage,
            choices=[
                oai.CompletionChoice(
                    index=i,
                    text=echo + f.text,
                    finish_reason=f.finish_reason,
                    logprobs=completion_logprobs(f.logprobs, self.token_str)
                    if self.wants_logprobs
                    else None,
                )
                for i, f in enumerate(finals)
            ],
        )

    def chunk(
        self,
        rid: str,
        index: int,
        text: str,
        finish_reason: str | None,
        first: bool,
        lps: TokenLogprobs | None,
    ) -> str:
        """One streamed chunk of choice ``index`` (``first``: its first, which carries the
        chat role); ``lps`` are sent when the request asked for logprobs."""
        obj: oai.ChatCompletionChunk | oai.CompletionResponse
        wanted = lps is not None and self.wants_logprobs
        if self.chat:
            shaper = self.shapers.setdefault(index, tool_calls.DeltaShaper(self.spec))
            delta, finish_reason = shaper(text, finish_reason)
            if first:
                delta.role = "assistant"
            lp = chat_logprobs(lps, self.token_str) if wanted and lps is not None else None
            choice = oai.ChatChunkChoice(
                index=index, delta=delta, finish_reason=finish_reason, logprobs=lp
            )
            obj = oai.ChatCompletionChunk(id=rid, model=self.model, choices=[choice])
        else:
            lp2 = completion_logprobs(lps, self.token_str) if wanted and lps is not None else None
            cc = oai.CompletionChoice(
                index=index, text=text, finish_reason=finish_reason, logprobs=lp2
            )
            obj = oai.CompletionResponse(id=rid, model=self.model, choices=[cc])
        return sse(obj)

    def usage_chunk(self, rid: str, usage: oai.Usage) -> str:
        obj: oai.ChatCompletionChunk | oai.CompletionResponse
        if self.chat:
            obj = oai.ChatCompletionChunk(id=rid, model=self.model, choices=[], usage=usage)
        else:
            obj = oai.CompletionResponse(id=rid, model=self.model, choices=[], usage=usage)
        return f"data: {json.dumps(obj.model_dump(exclude_none=True) | {'choices': []})}\n\n"


async def stream_response(
    chunks: AsyncIterator[str],
    items: AsyncIterator[Any],
    headers: dict[str, str] | None = None,
    refused: tuple[type[Exception], ...] = (),
    failed: tuple[type[Exception], ...] = (),
) -> Response:
    """The SSE answer of ``chunks``, sent once the first chunk is there.

    ``refused``: errors of the first chunk that are the request's fault, a 400;
    ``failed``: errors after the headers went out, sent in-band before ``[DONE]``. Once
    done or cancelled (the client went away), both generators are closed, so that the
    engine requests still open are aborted now, not at garbage collection.
    """
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = DONE
    except refused as exc:
        await items.aclose()  # type: ignore[attr-defined]
        raise oai.APIError(oai.INVALID_PARAMETER, str(exc)) from exc

    async def body() -> AsyncIterator[str]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except failed as exc:
            _, error = oai.make_error(oai.INTERNAL_ERROR, str(exc))
            yield f"data: {json.dumps(error.model_dump())}\n\n"
            yield DONE
        finally:
            with contextlib.suppress(RuntimeError):
                await chunks.aclose()  # type: ignore[attr-defined]
                await items.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def stream_chunks(
    shapes: Shapes,
    rid: str,
    items: AsyncIterator[tuple[int, Any]],
    usage: Callable[[], oai.Usage],
    echo: str = "",
    on_output: Callable[[int, Any], None] | None = None,
    skip_partial: bool = False,
) -> AsyncIterator[str]:
    """The chunks of a streamed answer: each output of each choice (``echo`` before a
    choice's first), then the usage (when asked for) and ``[DONE]``.

    ``on_output(tag, out)`` sees every output first; with ``skip_partial``, an output
    with no text yet (a token that completes no character, part of a UTF-8 sequence) is
    not sent unless it ends its choice or logprobs are asked for.
    """
    started: set[int] = set()
    async for tag, out in items:
        if on_output is not None:
            on_output(tag, out)
        wants = shapes.wants_logprobs
        if skip_partial and not (out.new_text or out.finished or tag not in started or wants):
            continue
        text = out.new_text
        first = tag not in started
        if first:
            started.add(tag)
            text = echo + text
        lps = list(zip(out.new_token_ids, out.new_logprobs, strict=False)) if wants else None
        yield shapes.chunk(rid, tag, text, out.finish_reason, first, lps)
    if shapes.body.include_usage_in_stream():
        yield shapes.usage_chunk(rid, usage())
    yield DONE
