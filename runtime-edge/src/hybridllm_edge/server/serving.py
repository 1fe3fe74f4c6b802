"""Chat and text completions: request -> engine requests (or the cache) -> OpenAI responses/SSE.

A request with ``n`` choices becomes ``n`` engine requests whose outputs arrive, tagged by
choice index, on one asyncio queue. A stream is answered only after its first item
arrives, so a failure at admission is an HTTP error rather than a broken stream. A client
that goes away aborts every engine request it started; the engine releases their KV slots
at its next step.

Every answer carries its confidence, the mean log-probability of its tokens, in the
``x-hybridllm-mean-logprob`` header (non-streaming) and in ``usage.mean_logprob`` (both;
streams send ``usage`` when ``stream_options.include_usage`` is set). ``x-hybridllm-cache``
says ``hit``, ``miss`` (cacheable, computed and stored) or ``bypass`` (not cacheable).

The checks, the outputs' queue and the answers' shapes are the cloud runtime's too
(``hybridllm_common.serving.requests`` and ``.responses``); this module is what the edge
adds: its engine's requests, the response cache, the confidence header.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from hybridllm_common import admission, structured, tool_calls
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import requests, responses
from hybridllm_edge import cache, engine, sampling

CACHE_HEADER = "x-hybridllm-cache"
CONFIDENCE_HEADER = "x-hybridllm-mean-logprob"


@dataclass
class ChoiceState:
    pieces: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, sampling.Choice]] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    logprob_sum: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in the slot's KV (the prompt cache)

    def final(self) -> responses.Final:
        return responses.Final("".join(self.pieces), self.finish_reason, self.logprobs)


class Serving:
    def __init__(self, app: FastAPI, error: Callable[..., Exception]) -> None:
        self.app = app
        self.error = error
        self.engine: engine.Engine = getattr(app.state, "engine", None)  # type: ignore[assignment]
        self.metrics = app.state.metrics
        self.cache: cache.ResponseCache | None = app.state.cache
        self.tool_spec: tool_calls.ToolSpec | None = None  # the chat request's tools

    # --- admission ------------------------------------------------------------------------

    def _check_ready(self, model: str) -> None:
        requests.check_ready(self.app)
        requests.check_model(self.app, model)

    def _params(
        self, body: responses.Body, prompt_len: int, logprobs: int | None
    ) -> sampling.SamplingParams:
        max_len = self.engine.info.max_model_len
        return sampling.SamplingParams(
            **requests.sampling_fields(body, prompt_len, max_len, logprobs)
        )

    def _cache_key(
        self, body: responses.Body, request: Request, prompt: Any, wants_logprobs: bool
    ) -> str | None:
        """The cache key when this request may be answered from / stored in the cache."""
        if self.cache is None or body.n != 1 or wants_logprobs:
            return None
        choice = request.headers.get(CACHE_HEADER, "").lower()
        opted_in = choice == "allow" or (body.model_extra or {}).get("cache") is True
        if choice == "bypass" or not (body.temperature == 0.0 or opted_in):
            return None
        endpoint = "chat" if isinstance(body, oai.ChatCompletionRequest) else "completions"
        revision = self.engine.info.revision
        return cache.make_key(revision, endpoint, prompt, body.model_dump(exclude_unset=False))

    def _start(
        self,
        prompt: list[int],
        params: sampling.SamplingParams,
        n: int,
        salt: str = "",
        grammars: list[structured.Matcher | None] | None = None,
    ) -> tuple[list[str], asyncio.Queue[tuple[int, Any]]]:
        requests.check_capacity(self.app, self.engine.num_waiting)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        ids = requests.request_ids(n)
        for i, rid in enumerate(ids):
            p = requests.choice_params(params, i)

            def emit(item: Any, tag: int = i) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (tag, item))

            grammar = grammars[i] if grammars else None
            self.engine.add(
                engine.EngineRequest(rid, list(prompt), p, emit, cache_salt=salt, grammar=grammar)
            )
        self.metrics.prompt_tokens.inc(len(prompt) * n)
        return ids, queue

    # --- endpoints ------------------------------------------------------------------------

    async def chat(self, body: oai.ChatCompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body)
        template = self.app.state.template
        plan = tool_calls.plan_chat(body, template.source)
        self.tool_spec = plan.spec
        # The key holds every message field (tool calls too) and the tools and format,
        # through the body; the normalised text makes near-identical prompts one entry.
        normalized = [[m["role"], cache.normalize(m["content"])] for m in plan.messages]
        key = self._cache_key(body, request, normalized, body.logprobs)
        if key is not None and (hit := self._lookup(key)) is not None:
            return self._from_cache(body, hit)
        text = requests.render_chat(lambda: template.render(plan.messages, plan.tools))
        prompt = self.engine.backend.encode(text, add_special=False)
        top = body.top_logprobs or 0
        params = self._params(body, len(prompt), top if body.logprobs else None)
        params = dataclasses.replace(params, constraint=plan.constraint)
        return await self._generate(body, request, prompt, params, key, "")

    async def completion(self, body: oai.CompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body)
        text, prompt = requests.completion_prompt(
            body,
            lambda t: self.engine.backend.encode(t, add_special=True),
            self.engine.info.vocab_size,
        )
        cache_prompt = cache.normalize(text) if text is not None else prompt
        key = self._cache_key(body, request, cache_prompt, body.logprobs is not None)
        if key is not None and (hit := self._lookup(key)) is not None:
            return self._from_cache(body, hit)
        params = self._params(body, len(prompt), body.logprobs)
        params = dataclasses.replace(params, constraint=structured.from_request(body))
        echo = ""
        if body.echo:
            echo = text if text is not None else self._detok(prompt)
        return await self._generate(body, request, prompt, params, key, echo)

    # --- generation -----------------------------------------------------------------------

    async def _generate(
        self,
        body: responses.Body,
        request: Request,
        prompt: list[int],
        params: sampling.SamplingParams,
        key: str | None,
        echo: str,
    ) -> Response:
        grammars = await requests.grammars(
            lambda: self.engine.vocabulary, params.constraint, body.n, self.metrics
        )
        ids, queue = self._start(prompt, params, body.n, body.cache_salt or "", grammars)
        # one clock for the request's choices (the cloud runtime keeps one per choice)
        items: AsyncIterator[tuple[int, engine.Output]] = requests.outputs(
            ids, queue, self.engine.abort, self.metrics, clock_per_choice=False
        )
        choices = [ChoiceState() for _ in ids]
        status = "miss" if key is not None else "bypass"
        headers = {CACHE_HEADER: status}
        if key is not None:
            self.metrics.cache_misses.inc()

        def record(tag: int, out: engine.Output) -> None:
            c = choices[tag]
            if out.new_text:
                c.pieces.append(out.new_text)
            c.logprobs.extend(zip(out.new_token_ids, out.new_logprobs, strict=True))
            c.num_tokens = out.num_output_tokens
            c.cached_tokens = out.num_cached_tokens
            c.logprob_sum += sum(lp.logprob for lp in out.new_logprobs)
            if out.finished:
                c.finish_reason = out.finish_reason
                if (
                    key is not None
                    and self.cache is not None
                    and out.finish_reason in ("stop", "length")
                ):
                    self.cache.put(key, self._answer(prompt, c))

        shapes = self._shapes(body)
        if body.stream:
            chunks = responses.stream_chunks(
                shapes,
                ids[0],
                items,
                lambda: self._usage(prompt, choices),
                echo,
                record,
                skip_partial=True,
            )
            return await responses.stream_response(chunks, items, headers)

        async def gather() -> None:
            async for tag, out in items:
                record(tag, out)

        async def close() -> None:
            await items.aclose()  # type: ignore[attr-defined]

        await requests.until_disconnected(gather(), request, close)
        usage = self._usage(prompt, choices)
        headers[CONFIDENCE_HEADER] = f"{usage.mean_logprob:.6f}"
        return shapes.response(ids[0], [c.final() for c in choices], usage, echo, headers)

    def _shapes(self, body: responses.Body) -> responses.Shapes:
        return responses.Shapes(body, self.app.state.model_name, self._token_str, self.tool_spec)

    def _token_str(self, token_id: int) -> str:
        return self.engine.backend.token_bytes(token_id).decode("utf-8", "replace")

    def _detok(self, ids: list[int]) -> str:
        raw = b"".join(self.engine.backend.token_bytes(t) for t in ids)
        return raw.decode("utf-8", "replace")

    @staticmethod
    def _usage(prompt: list[int], choices: list[ChoiceState]) -> oai.Usage:
        completion = sum(c.num_tokens for c in choices)
        total_lp = sum(c.logprob_sum for c in choices)
        return responses.usage(
            len(prompt),
            completion,
            # of the prompt, the tokens served from the prompt cache (every choice's, when
            # n > 1 ran each in a slot of its own)
            min(c.cached_tokens for c in choices),
            total_lp / completion if completion else None,
        )

    # --- cache ----------------------------------------------------------------------------

    def _lookup(self, key: str) -> cache.CachedAnswer | None:
        assert self.cache is not None
        hit = self.cache.get(key)
        if hit is not None:
            self.metrics.cache_hits.inc()
        return hit

    @staticmethod
    def _answer(prompt: list[int], c: ChoiceState) -> cache.CachedAnswer:
        return cache.CachedAnswer(
            pieces=tuple(c.pieces),
            finish_reason=c.finish_reason or "stop",
            prompt_tokens=len(prompt),
            completion_tokens=c.num_tokens,
            mean_logprob=c.logprob_sum / c.num_tokens if c.num_tokens else None,
        )

    def _from_cache(self, body: responses.Body, hit: cache.CachedAnswer) -> Response:
        headers = {CACHE_HEADER: "hit"}
        usage = oai.Usage(
            prompt_tokens=hit.prompt_tokens,
            completion_tokens=hit.completion_tokens,
            total_tokens=hit.prompt_tokens + hit.completion_tokens,
            mean_logprob=hit.mean_logprob,
        )
        kind = "chatcmpl" if isinstance(body, oai.ChatCompletionRequest) else "cmpl"
        rid = oai.new_id(kind)
        shapes = self._shapes(body)
        if body.stream:
            return StreamingResponse(
                self._replay(shapes, rid, hit, usage),
                media_type="text/event-stream",
                headers=headers,
            )
        if hit.mean_logprob is not None:
            headers[CONFIDENCE_HEADER] = f"{hit.mean_logprob:.6f}"
        final = responses.Final("".join(hit.pieces), hit.finish_reason)
        return shapes.response(rid, [final], usage, "", headers)

    @staticmethod
    async def _replay(
        shapes: responses.Shapes, rid: str, hit: cache.CachedAnswer, usage: oai.Usage
    ) -> AsyncIterator[str]:
        pieces = list(hit.pieces) or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield shapes.chunk(rid, 0, piece, hit.finish_reason if last else None, i == 0, None)
        if shapes.body.include_usage_in_stream():
            yield shapes.usage_chunk(rid, usage)
        yield responses.DONE
