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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridllm_common import admission, structured, tool_calls
from hybridllm_common import openai_protocol as oai
from hybridllm_edge import cache, engine, sampling
from hybridllm_edge.server import responses
from hybridllm_edge.server.responses import Body, ChoiceState

CACHE_HEADER = "x-hybridllm-cache"
CONFIDENCE_HEADER = "x-hybridllm-mean-logprob"


class Serving(responses.ResponseShapes):
    def __init__(self, app: FastAPI, error: Callable[..., Exception]) -> None:
        self.app = app
        self.error = error
        self.engine: engine.Engine = getattr(app.state, "engine", None)  # type: ignore[assignment]
        self.metrics = app.state.metrics
        self.cache: cache.ResponseCache | None = app.state.cache
        self.chat_kind = True
        self.tool_spec: tool_calls.ToolSpec | None = None  # the chat request's tools
        self.shapers: dict[int, tool_calls.DeltaShaper] = {}  # per streamed choice

    # --- admission ------------------------------------------------------------------------

    def _check_ready(self, model: str) -> None:
        if not self.app.state.ready:
            raise self.error(oai.MODEL_NOT_READY, self.app.state.not_ready_reason)
        if model and model != self.app.state.model_name:
            raise self.error(oai.MODEL_NOT_FOUND, f"model {model!r} is not served here", "model")

    def _params(self, body: Body, prompt_len: int, logprobs: int | None) -> sampling.SamplingParams:
        max_tokens = admission.max_new_tokens(body, prompt_len, self.engine.info.max_model_len)
        return sampling.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=tuple(body.stop_list()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
        )

    def _cache_key(
        self, body: Body, request: Request, prompt: Any, wants_logprobs: bool
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

    async def _grammars(
        self, constraint: structured.Constraint | None, n: int
    ) -> list[structured.Matcher | None]:
        """One matcher per choice (``structured.matchers``: checked and built off the event
        loop and the engine's step loop)."""
        if constraint is None:
            return [None] * n
        built = await structured.matchers(lambda: self.engine.vocabulary, constraint, n)
        self.metrics.structured.labels(kind=constraint.kind).inc()
        return list(built)

    def _start(
        self,
        prompt: list[int],
        params: sampling.SamplingParams,
        n: int,
        salt: str = "",
        grammars: list[structured.Matcher | None] | None = None,
    ) -> tuple[list[str], asyncio.Queue[tuple[int, Any]]]:
        if self.engine.num_waiting >= self.app.state.settings.max_waiting_requests:
            raise self.error(
                oai.SERVER_OVERLOADED,
                "too many queued requests, retry later",
                None,
                {"Retry-After": str(self.app.state.settings.retry_after_seconds)},
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        base = oai.new_id("req")
        ids = [f"{base}-{i}" for i in range(n)]
        for i, rid in enumerate(ids):
            p = params
            if params.seed is not None and i:
                p = sampling.SamplingParams(**{**params.__dict__, "seed": params.seed + i})

            def emit(item: Any, tag: int = i) -> None:
                loop.call_soon_threadsafe(queue.put_nowait, (tag, item))

            grammar = grammars[i] if grammars else None
            self.engine.add(
                engine.EngineRequest(rid, list(prompt), p, emit, cache_salt=salt, grammar=grammar)
            )
        self.metrics.prompt_tokens.inc(len(prompt) * n)
        return ids, queue

    async def _items(
        self, ids: list[str], queue: asyncio.Queue[tuple[int, Any]]
    ) -> AsyncIterator[tuple[int, engine.Output]]:
        """Outputs of all choices until each finished; aborts the rest if left early."""
        open_tags = set(range(len(ids)))
        start = time.monotonic()
        last: float | None = None
        try:
            while open_tags:
                tag, item = await queue.get()
                if isinstance(item, BaseException):
                    open_tags.discard(tag)
                    raise item
                now = time.monotonic()
                (self.metrics.ttft if last is None else self.metrics.tbt).observe(
                    now - (start if last is None else last)
                )
                last = now
                self.metrics.generation_tokens.inc(len(item.new_token_ids))
                if item.finished:
                    open_tags.discard(tag)
                    self.metrics.e2e.observe(now - start)
                    self.metrics.requests.labels(finish_reason=item.finish_reason or "").inc()
                yield tag, item
        finally:
            for tag in open_tags:
                self.engine.abort(ids[tag])

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
        try:
            text = template.render(plan.messages, plan.tools)
        except Exception as exc:
            raise self.error(oai.INVALID_REQUEST, f"chat template: {exc}", "messages") from exc
        prompt = self.engine.backend.encode(text, add_special=False)
        top = body.top_logprobs or 0
        params = self._params(body, len(prompt), top if body.logprobs else None)
        params = dataclasses.replace(params, constraint=plan.constraint)
        return await self._generate(body, request, prompt, params, key, "")

    async def completion(self, body: oai.CompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise self.error(oai.INVALID_PARAMETER, "prompt: one prompt per request", "prompt")
            text: str | None = str(body.prompt[0])
        else:
            text = body.prompt if isinstance(body.prompt, str) else None
        if text is not None:
            prompt = self.engine.backend.encode(text, add_special=True)
        else:
            prompt = admission.prompt_token_ids(body.prompt, self.engine.info.vocab_size)
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
        body: Body,
        request: Request,
        prompt: list[int],
        params: sampling.SamplingParams,
        key: str | None,
        echo: str,
    ) -> Response:
        grammars = await self._grammars(params.constraint, body.n)
        ids, queue = self._start(prompt, params, body.n, body.cache_salt or "", grammars)
        items = self._items(ids, queue)
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

        if body.stream:
            chunks = self._stream_chunks(body, ids[0], prompt, items, record, choices, echo)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = "data: [DONE]\n\n"

            async def stream() -> AsyncIterator[str]:
                try:
                    yield first
                    async for chunk in chunks:
                        yield chunk
                finally:
                    with contextlib.suppress(RuntimeError):
                        await chunks.aclose()
                        await items.aclose()  # type: ignore[attr-defined]

            return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
        await self._collect(items, request, record)
        usage = self._usage(prompt, choices)
        headers[CONFIDENCE_HEADER] = f"{usage.mean_logprob:.6f}"
        resp = self._full_response(body, ids[0], choices, usage, echo)
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    async def _collect(
        self,
        items: AsyncIterator[tuple[int, engine.Output]],
        request: Request,
        record: Callable[[int, engine.Output], None],
    ) -> None:
        """Runs every choice to its end, racing the client's disconnect."""

        async def gather() -> None:
            async for tag, out in items:
                record(tag, out)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await items.aclose()  # type: ignore[attr-defined]
        if work.cancelled():
            raise self.error(oai.INVALID_REQUEST, "client disconnected")
        work.result()  # re-raises an engine error

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

    def _from_cache(self, body: Body, hit: cache.CachedAnswer) -> Response:
        headers = {CACHE_HEADER: "hit"}
        usage = oai.Usage(
            prompt_tokens=hit.prompt_tokens,
            completion_tokens=hit.completion_tokens,
            total_tokens=hit.prompt_tokens + hit.completion_tokens,
            mean_logprob=hit.mean_logprob,
        )
        c = ChoiceState(pieces=list(hit.pieces), finish_reason=hit.finish_reason)
        kind = "chatcmpl" if isinstance(body, oai.ChatCompletionRequest) else "cmpl"
        rid = oai.new_id(kind)
        if body.stream:
            return StreamingResponse(
                self._replay(body, rid, hit, usage), media_type="text/event-stream", headers=headers
            )
        if hit.mean_logprob is not None:
            headers[CONFIDENCE_HEADER] = f"{hit.mean_logprob:.6f}"
        resp = self._full_response(body, rid, [c], usage, "")
        return JSONResponse(resp.model_dump(exclude_none=True), headers=headers)

    async def _replay(
        self, body: Body, rid: str, hit: cache.CachedAnswer, usage: oai.Usage
    ) -> AsyncIterator[str]:
        pieces = list(hit.pieces) or [""]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield self._chunk(
                body, rid, 0, piece, hit.finish_reason if last else None, i == 0, None
            )
        if body.include_usage_in_stream():
            yield self._usage_chunk(body, rid, usage)
        yield "data: [DONE]\n\n"

    async def _stream_chunks(
        self,
        body: Body,
        rid: str,
        prompt: list[int],
        items: AsyncIterator[tuple[int, engine.Output]],
        record: Callable[[int, engine.Output], None],
        choices: list[ChoiceState],
        echo: str,
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        async for tag, out in items:
            record(tag, out)
            wants_logprobs = (
                body.logprobs is True
                if isinstance(body, oai.ChatCompletionRequest)
                else body.logprobs is not None
            )
            if not out.new_text and not out.finished and tag in started and not wants_logprobs:
                continue  # a token that completes no character yet (part of a UTF-8 sequence)
            text = out.new_text
            first = tag not in started
            if first:
                started.add(tag)
                text = echo + text
            lps = list(zip(out.new_token_ids, out.new_logprobs, strict=True))
            yield self._chunk(body, rid, tag, text, out.finish_reason, first, lps)
        if body.include_usage_in_stream():
            yield self._usage_chunk(body, rid, self._usage(prompt, choices))
        yield "data: [DONE]\n\n"
