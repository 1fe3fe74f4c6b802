"""Chat and text completions: request -> engine requests -> OpenAI responses or SSE.

A request with ``n`` choices becomes ``n`` engine requests (the prompt's blocks are shared
through the prefix cache) whose outputs arrive, tagged by choice index, on one asyncio
queue; with ``best_of > n`` it becomes ``best_of`` of them and the ``n`` with the highest
mean token logprob are returned. A beam search (vLLM's ``use_beam_search``, width
``best_of``) is one engine request whose final output carries the ``n`` best sequences. A stream is answered only after its first item arrives, so a failure at admission
is an HTTP error rather than a broken stream. A client that goes away (stream cancelled,
or ``http.disconnect`` while a non-streaming answer is computed) aborts every engine
request it started, which frees their KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridllm_cloud.engine import async_engine
from hybridllm_cloud.engine.llm_engine import RequestOutput
from hybridllm_cloud.engine.request import Priority, SamplingParams
from hybridllm_common import admission, structured, tool_calls
from hybridllm_common import openai_protocol as oai

Item = tuple[int, RequestOutput | BaseException]
T = TypeVar("T")

# Parameters the shared admission refuses that this runtime implements (checked here).
SUPPORTED_HERE = frozenset({"best_of", "use_beam_search", "length_penalty", "early_stopping"})
MAX_BEST_OF = 32


@dataclass(frozen=True)
class _Search:
    """How the ``n`` choices are made: ``n`` samples, the best ``n`` of ``best_of``, or beams."""

    n: int
    best_of: int
    beam: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @property
    def ranked(self) -> bool:
        """Sampling with more candidates than choices: the best ``n`` by mean logprob."""
        return not self.beam and self.best_of > self.n


@dataclass
class _Timing:
    start: float = field(default_factory=time.monotonic)
    last: float | None = None


class Serving:
    def __init__(self, app: FastAPI, error: Callable[..., Exception]) -> None:
        self.app = app
        self.error = error
        if not app.state.ready:  # no engine yet, or none at all (the model was refused)
            raise error(oai.MODEL_NOT_READY, app.state.not_ready_reason)
        self.engine = app.state.engine
        self.tokenizer = self.engine.engine.tokenizer
        self.metrics = app.state.metrics
        self.max_len: int = self.engine.engine.info.max_model_len
        self.vocab_size: int = self.engine.engine.model.config.vocab_size

    # --- admission ------------------------------------------------------------------------

    def _check_ready(self, model: str) -> None:
        if model and model != self.app.state.model_name:
            raise self.error(oai.MODEL_NOT_FOUND, f"model {model!r} is not served here", "model")

    def _params(
        self,
        body: oai.ChatCompletionRequest | oai.CompletionRequest,
        prompt_len: int,
        logprobs: int | None,
    ) -> SamplingParams:
        max_tokens = admission.max_new_tokens(body, prompt_len, self.max_len)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=tuple(body.stop_list()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            cache_salt=body.cache_salt or "",
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
        )
        return params

    def _search(self, body: oai.ChatCompletionRequest | oai.CompletionRequest) -> _Search:
        """``n``, ``best_of`` and vLLM's ``use_beam_search`` / ``length_penalty`` /
        ``early_stopping``, checked; what beam search cannot honour is refused by name."""
        extra = body.model_extra or {}

        def bad(param: str, message: str) -> Exception:
            return self.error(oai.INVALID_PARAMETER, f"{param}: {message}", param)

        beam = extra.get("use_beam_search", False)
        if not isinstance(beam, bool):
            raise bad("use_beam_search", "must be a boolean")
        best_of = extra.get("best_of")
        if best_of is None:
            best_of = body.n
        if isinstance(best_of, bool) or not isinstance(best_of, int):
            raise bad("best_of", "must be an integer")
        if not body.n <= best_of <= MAX_BEST_OF:
            raise bad("best_of", f"must be in [n, {MAX_BEST_OF}] (n is {body.n})")
        length_penalty = extra.get("length_penalty", 1.0)
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, int | float):
            raise bad("length_penalty", "must be a number")
        early_stopping = extra.get("early_stopping", False)
        if early_stopping not in (True, False, "never"):
            raise bad("early_stopping", 'must be true, false or "never"')
        if not beam:
            if length_penalty != 1.0:
                raise bad("length_penalty", "only with use_beam_search")
            if early_stopping is not False:
                raise bad("early_stopping", "only with use_beam_search")
            if best_of > body.n and body.stream:
                raise bad("best_of", "not supported with stream (choices are ranked at the end)")
            return _Search(n=body.n, best_of=best_of)
        if body.stream:
            raise bad(
                "stream",
                "not supported with use_beam_search yet (beams are ranked only when the "
                "search ends); send stream=false",
            )
        if body.temperature not in (None, 0.0):
            raise bad("temperature", "beam search is deterministic: leave it out or send 0")
        if body.top_p not in (None, 1.0):
            raise bad("top_p", "beam search is deterministic: leave it out or send 1")
        if body.top_k not in (None, 0, -1):
            raise bad("top_k", "beam search is deterministic: leave it out")
        return _Search(
            n=body.n,
            best_of=best_of,
            beam=True,
            length_penalty=float(length_penalty),
            early_stopping=early_stopping,
        )

    def _search_params(self, params: SamplingParams, search: _Search) -> SamplingParams:
        """The engine's parameters for ``search``; engine-side refusals become 400s."""
        if search.beam:
            params = dataclasses.replace(
                params,
                temperature=0.0,
                use_beam_search=True,
                beam_width=search.best_of,
                length_penalty=search.length_penalty,
                early_stopping=search.early_stopping,
                num_return_sequences=search.n,
            )
        elif search.ranked and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # to rank the candidates
        try:
            params.validate()
        except ValueError as exc:
            param = str(exc).split(":", 1)[0]
            raise self.error(oai.INVALID_PARAMETER, str(exc), param) from exc
        return params

    def chat_text(self, plan: tool_calls.ChatPlan) -> str:
        """The messages (and tools) through the model's chat template (a 400 naming
        ``messages`` when the template refuses them)."""
        try:
            return self.tokenizer.apply_chat_template(plan.messages, tools=plan.tools)
        except Exception as exc:
            raise self.error(oai.INVALID_REQUEST, f"chat template: {exc}", "messages") from exc

    async def _grammars(self, params: SamplingParams, count: int) -> list[Any]:
        """One matcher per engine request (``structured.matchers``: checked and built off
        the event loop and the step loop)."""
        constraint = params.constraint
        if constraint is None:
            return [None] * count
        engine = self.engine.engine
        built = await structured.matchers(lambda: engine.vocabulary, constraint, count)
        self.metrics.structured.labels(kind=constraint.kind).inc()
        return list(built)

    def check_capacity(self) -> None:
        """503 with Retry-After when the engine's queue is at its bound."""
        if self.engine.num_waiting >= self.app.state.settings.max_waiting_requests:
            retry = str(self.app.state.settings.retry_after_seconds)
            raise self.error(
                oai.SERVER_OVERLOADED,
                "too many queued requests, retry later",
                None,
                {"Retry-After": retry},
            )

    def _start(
        self,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        best_of: int,
        beam: bool,
        priority: str,
        grammars: list[Any] | None = None,
    ) -> tuple[list[str], asyncio.Queue[Item]]:
        """One engine request per candidate (``best_of`` of them), or one for a beam search;
        ``grammars``: a structured output's matcher for each of them."""
        n = 1 if beam else max(n, best_of)
        self.check_capacity()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        base = oai.new_id("req")
        ids = [f"{base}-{i}" for i in range(n)]
        prio = Priority.BATCH if priority == "batch" else Priority.INTERACTIVE
        for i, request_id in enumerate(ids):
            p = params
            if params.seed is not None and i:
                p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
            grammar = grammars[i] if grammars else None
            self.engine.add(request_id, prompt, p, prio, queue, tag=i, grammar=grammar)
        self.metrics.prompt_tokens.inc(len(prompt) * n)
        return ids, queue

    async def _items(
        self, ids: list[str], queue: asyncio.Queue[Item]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all choices until each finished; aborts the rest if left early."""
        open_tags = set(range(len(ids)))
        timing = [_Timing() for _ in ids]
        try:
            while open_tags:
                tag, item = await queue.get()
                if isinstance(item, BaseException):
                    open_tags.discard(tag)
                    raise item
                self._observe(timing[tag], item)
                if item.finished:
                    open_tags.discard(tag)
                yield tag, item
        finally:
            for tag in open_tags:
                self.engine.abort(ids[tag])

    def _observe(self, t: _Timing, out: RequestOutput) -> None:
        now = time.monotonic()
        if t.last is None:
            self.metrics.ttft.observe(now - t.start)
        else:
            self.metrics.tbt.observe(now - t.last)
        t.last = now
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self.metrics.e2e.observe(now - t.start)
            self.metrics.requests.labels(finish_reason=out.finish_reason or "").inc()

    # --- endpoints ------------------------------------------------------------------------

    async def chat(self, body: oai.ChatCompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body, SUPPORTED_HERE)
        search = self._search(body)
        plan = tool_calls.plan_chat(body, self.tokenizer.chat_template)
        prompt = self.tokenizer.encode(self.chat_text(plan), add_special_tokens=False)
        top = body.top_logprobs or 0
        params = self._params(body, len(prompt), top if body.logprobs else None)
        params = dataclasses.replace(params, constraint=plan.constraint)
        params = self._search_params(params, search)
        count = 1 if search.beam else max(search.n, search.best_of)
        grammars = await self._grammars(params, count)
        ids, queue = self._start(
            prompt, params, search.n, search.best_of, search.beam, body.priority, grammars
        )
        items = self._items(ids, queue)
        if body.stream:
            return await self._stream(
                items, self._chat_chunks(body, ids[0], prompt, items, plan.spec)
            )
        finals = self._choose(await self._collect(items, request), search)
        choices = []
        for i, (out, lps) in enumerate(finals):
            message, reason = tool_calls.message(out.text, out.finish_reason, plan.spec)
            choices.append(
                oai.ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=reason,  # type: ignore[arg-type]
                    logprobs=self._chat_logprobs(lps) if body.logprobs else None,
                )
            )
        resp = oai.ChatCompletionResponse(
            id=ids[0],
            model=self.app.state.model_name,
            choices=choices,
            usage=self._usage(prompt, [f[0] for f in finals]),
        )
        return JSONResponse(resp.model_dump(exclude_none=True))

    async def completion(self, body: oai.CompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body, SUPPORTED_HERE)
        search = self._search(body)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise self.error(oai.INVALID_PARAMETER, "prompt: one prompt per request", "prompt")
            text: str | None = str(body.prompt[0])
        else:
            text = body.prompt if isinstance(body.prompt, str) else None
        if text is not None:
            prompt = self.tokenizer.encode(text)
        else:
            prompt = admission.prompt_token_ids(body.prompt, self.vocab_size)
        constraint = structured.from_request(body)
        params = self._params(body, len(prompt), body.logprobs)
        params = dataclasses.replace(params, constraint=constraint)
        params = self._search_params(params, search)
        count = 1 if search.beam else max(search.n, search.best_of)
        grammars = await self._grammars(params, count)
        ids, queue = self._start(
            prompt, params, search.n, search.best_of, search.beam, body.priority, grammars
        )
        items = self._items(ids, queue)
        echo = (text or self.tokenizer.decode(prompt)) if body.echo else ""
        if body.stream:
            return await self._stream(
                items, self._completion_chunks(body, ids[0], prompt, items, echo)
            )
        finals = self._choose(await self._collect(items, request), search)
        choices = [
            oai.CompletionChoice(
                index=i,
                text=echo + out.text,
                finish_reason=out.finish_reason,  # type: ignore[arg-type]
                logprobs=self._completion_logprobs(lps) if body.logprobs is not None else None,
            )
            for i, (out, lps) in enumerate(finals)
        ]
        resp = oai.CompletionResponse(
            id=ids[0],
            model=self.app.state.model_name,
            choices=choices,
            usage=self._usage(prompt, [f[0] for f in finals]),
        )
        return JSONResponse(resp.model_dump(exclude_none=True))

    # --- non-streaming --------------------------------------------------------------------

    async def _collect(
        self, items: AsyncIterator[tuple[int, RequestOutput]], request: Request
    ) -> list[tuple[RequestOutput, list[Any]]]:
        """Gathers every choice's final output, racing the client's disconnect."""
        finals: dict[int, RequestOutput] = {}
        logprobs: dict[int, list[Any]] = {}

        async def gather() -> None:
            async for tag, out in items:
                logprobs.setdefault(tag, []).extend(
                    zip(out.new_token_ids, out.new_logprobs, strict=False)
                )
                if out.finished:
                    finals[tag] = out

        async def close() -> None:
            await items.aclose()  # type: ignore[attr-defined]

        await self.until_disconnected(gather(), request, close)
        return [(finals[i], logprobs.get(i, [])) for i in sorted(finals)]

    async def until_disconnected(
        self,
        work: Coroutine[Any, Any, T],
        request: Request,
        on_cancel: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """``work``'s result, unless the client goes away first: then ``work`` is cancelled
        (which aborts its engine requests), ``on_cancel`` runs, and the answer is a 400."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if on_cancel is not None:
                    await on_cancel()
        if task.cancelled():
            raise self.error(oai.INVALID_REQUEST, "client disconnected")
        return task.result()  # re-raises an engine error

    @staticmethod
    def _choose(
        finals: list[tuple[RequestOutput, list[Any]]], search: _Search
    ) -> list[tuple[RequestOutput, list[Any]]]:
        """The returned choices: the beams, best first; the best ``n`` of ``best_of``
        samples by mean token logprob (OpenAI's "highest log probability per token");
        else every sample in order."""
        if search.beam:
            ((out, _),) = finals
            assert out.sequences is not None
            return [
                (
                    dataclasses.replace(
                        out,
                        token_ids=s.token_ids,
                        text=s.text,
                        finish_reason=s.finish_reason,
                        stop_reason=s.stop_reason,
                        sequences=None,
                    ),
                    [],
                )
                for s in out.sequences
            ]
        if not search.ranked:
            return finals

        def mean_logprob(item: tuple[RequestOutput, list[Any]]) -> float:
            lps = [lp.logprob for _, lp in item[1] if lp is not None]
            return sum(lps) / len(lps) if lps else float("-inf")

        order = sorted(range(len(finals)), key=lambda i: (-mean_logprob(finals[i]), i))
        return [finals[i] for i in order[: search.n]]

    def _usage(self, prompt: list[int], outs: list[RequestOutput]) -> oai.Usage:
        completion = sum(len(o.token_ids) for o in outs)
        cached = max((o.num_cached_tokens for o in outs), default=0)
        return oai.Usage(
            prompt_tokens=len(prompt),
            completion_tokens=completion,
            total_tokens=len(prompt) + completion,
            prompt_tokens_details={"cached_tokens": cached},
        )

    def _chat_logprobs(self, lps: list[Any]) -> oai.ChoiceLogprobs:
        tok = self.tokenizer
        return oai.ChoiceLogprobs(
            content=[
                oai.TokenLogprob(
                    token=tok.id_to_token(token_id),
                    logprob=lp.logprob,
                    top_logprobs=[
                        oai.TopLogprob(token=tok.id_to_token(t), logprob=v)
                        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                    ],
                )
                for token_id, lp in lps
            ]
        )

    def _completion_logprobs(self, lps: list[Any]) -> oai.CompletionLogprobs:
        tok = self.tokenizer
        out = oai.CompletionLogprobs()
        offset = 0
        for token_id, lp in lps:
            text = tok.id_to_token(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(
                {
                    tok.id_to_token(t): v
                    for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
                }
            )
            out.text_offset.append(offset)
            offset += len(text)
        return out

    # --- streaming ------------------------------------------------------------------------

    async def _stream(self, items: AsyncIterator[Any], chunks: AsyncIterator[str]) -> Response:
        try:
            first = await anext(chunks)
        except ValueError as exc:
            await items.aclose()  # type: ignore[attr-defined]
            raise self.error(oai.INVALID_PARAMETER, str(exc)) from exc

        async def body() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except async_engine.RequestFailed as exc:
                # Headers are sent: the failure goes in-band, then the stream ends cleanly.
                _, error = oai.make_error(oai.INTERNAL_ERROR, str(exc))
                yield f"data: {json.dumps(error.model_dump())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                # Cancelled (client gone) or done: close both generators so that the
                # engine requests still open are aborted now, not at garbage collection.
                with contextlib.suppress(RuntimeError):
                    await chunks.aclose()  # type: ignore[attr-defined]
                    await items.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(body(), media_type="text/event-stream")

    @staticmethod
    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj.model_dump(exclude_none=True))}\n\n"

    async def _chat_chunks(
        self,
        body: oai.ChatCompletionRequest,
        rid: str,
        prompt: list[int],
        items: AsyncIterator[tuple[int, RequestOutput]],
        spec: tool_calls.ToolSpec | None,
    ) -> AsyncIterator[str]:
        model = self.app.state.model_name
        finals: list[RequestOutput] = []
        started: set[int] = set()
        shapers: dict[int, tool_calls.DeltaShaper] = {}
        async for tag, out in items:
            shaper = shapers.setdefault(tag, tool_calls.DeltaShaper(spec))
            delta, reason = shaper(out.new_text, out.finish_reason)
            if tag not in started:
                started.add(tag)
                delta.role = "assistant"
            lp = None
            if body.logprobs:
                lp = self._chat_logprobs(
                    list(zip(out.new_token_ids, out.new_logprobs, strict=False))
                )
            choice = oai.ChatChunkChoice(index=tag, delta=delta, finish_reason=reason, logprobs=lp)  # type: ignore[arg-type]
            yield self._sse(oai.ChatCompletionChunk(id=rid, model=model, choices=[choice]))
            if out.finished:
                finals.append(out)
        if body.include_usage_in_stream():
            chunk = oai.ChatCompletionChunk(
                id=rid, model=model, choices=[], usage=self._usage(prompt, finals)
            )
            yield f"data: {json.dumps(chunk.model_dump(exclude_none=True) | {'choices': []})}\n\n"
        yield "data: [DONE]\n\n"

    async def _completion_chunks(
        self,
        body: oai.CompletionRequest,
        rid: str,
        prompt: list[int],
        items: AsyncIterator[tuple[int, RequestOutput]],
        echo: str,
    ) -> AsyncIterator[str]:
        model = self.app.state.model_name
        finals: list[RequestOutput] = []
        started: set[int] = set()
        async for tag, out in items:
            text = out.new_text
            if tag not in started:
                started.add(tag)
                text = echo + text
            lp = None
            if body.logprobs is not None:
                lp = self._completion_logprobs(
                    list(zip(out.new_token_ids, out.new_logprobs, strict=False))
                )
            choice = oai.CompletionChoice(
                index=tag, text=text, finish_reason=out.finish_reason, logprobs=lp
            )  # type: ignore[arg-type]
            yield self._sse(oai.CompletionResponse(id=rid, model=model, choices=[choice]))
            if out.finished:
                finals.append(out)
        if body.include_usage_in_stream():
            chunk = oai.CompletionResponse(
                id=rid, model=model, choices=[], usage=self._usage(prompt, finals)
            )
            yield self._sse(chunk)
        yield "data: [DONE]\n\n"
