"""Chat and text completions: request -> engine requests -> OpenAI responses or SSE.

A request with ``n`` choices becomes ``n`` engine requests (the prompt's blocks are shared
through the prefix cache) whose outputs arrive, tagged by choice index, on one asyncio
queue; with ``best_of > n`` it becomes ``best_of`` of them and the ``n`` with the highest
mean token logprob are returned. A beam search (vLLM's ``use_beam_search``, width
``best_of``) is one engine request whose final output carries the ``n`` best sequences. A stream is answered only after its first item arrives, so a failure at admission
is an HTTP error rather than a broken stream. A client that goes away (stream cancelled,
or ``http.disconnect`` while a non-streaming answer is computed) aborts every engine
request it started, which frees their KV blocks at the next step boundary.

The checks, the outputs' queue and the answers' shapes are the edge runtime's too
(``hybridllm_common.serving.requests`` and ``.responses``); this module is what the
engine adds: ``best_of`` ranking, beam search, prefix-cache salts, priorities.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridllm_cloud.engine import async_engine
from hybridllm_cloud.engine.llm_engine import RequestOutput
from hybridllm_cloud.engine.request import Priority
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_common import admission, structured, tool_calls
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import requests, responses

Item = tuple[int, RequestOutput | BaseException]

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


class Serving:
    def __init__(self, app: FastAPI, error: Callable[..., Exception]) -> None:
        self.app = app
        self.error = error
        requests.check_ready(app)
        self.engine = app.state.engine
        self.tokenizer = self.engine.engine.tokenizer
        self.metrics = app.state.metrics
        self.max_len: int = self.engine.engine.info.max_model_len
        self.vocab_size: int = self.engine.engine.model.config.vocab_size

    # --- admission ------------------------------------------------------------------------

    def _check_ready(self, model: str) -> None:
        requests.check_model(self.app, model)

    def _params(
        self,
        body: oai.ChatCompletionRequest | oai.CompletionRequest,
        prompt_len: int,
        logprobs: int | None,
    ) -> SamplingParams:
        fields = requests.sampling_fields(body, prompt_len, self.max_len, logprobs)
        return SamplingParams(**fields, cache_salt=body.cache_salt or "")

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
        return requests.render_chat(
            lambda: self.tokenizer.apply_chat_template(plan.messages, tools=plan.tools)
        )

    async def _grammars(self, params: SamplingParams, count: int) -> list[Any]:
        engine = self.engine.engine
        return await requests.grammars(
            lambda: engine.vocabulary, params.constraint, count, self.metrics
        )

    def check_capacity(self) -> None:
        requests.check_capacity(self.app, self.engine.num_waiting)

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
        ids = requests.request_ids(n)
        prio = Priority.BATCH if priority == "batch" else Priority.INTERACTIVE
        for i, request_id in enumerate(ids):
            p = requests.choice_params(params, i)
            grammar = grammars[i] if grammars else None
            self.engine.add(request_id, prompt, p, prio, queue, tag=i, grammar=grammar)
        self.metrics.prompt_tokens.inc(len(prompt) * n)
        return ids, queue

    def _items(
        self, ids: list[str], queue: asyncio.Queue[Item]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all choices until each finished; aborts the rest if left early."""
        return requests.outputs(ids, queue, self.engine.abort, self.metrics)

    def _shapes(
        self,
        body: oai.ChatCompletionRequest | oai.CompletionRequest,
        spec: tool_calls.ToolSpec | None = None,
    ) -> responses.Shapes:
        return responses.Shapes(body, self.app.state.model_name, self.tokenizer.id_to_token, spec)

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
        return await self._generate(body, request, prompt, params, search, plan.spec, "")

    async def completion(self, body: oai.CompletionRequest, request: Request) -> Response:
        self._check_ready(body.model)
        admission.refuse_unsupported(body, SUPPORTED_HERE)
        search = self._search(body)
        text, prompt = requests.completion_prompt(body, self.tokenizer.encode, self.vocab_size)
        constraint = structured.from_request(body)
        params = self._params(body, len(prompt), body.logprobs)
        params = dataclasses.replace(params, constraint=constraint)
        echo = (text or self.tokenizer.decode(prompt)) if body.echo else ""
        return await self._generate(body, request, prompt, params, search, None, echo)

    async def _generate(
        self,
        body: oai.ChatCompletionRequest | oai.CompletionRequest,
        request: Request,
        prompt: list[int],
        params: SamplingParams,
        search: _Search,
        spec: tool_calls.ToolSpec | None,
        echo: str,
    ) -> Response:
        """The engine requests of ``search``, streamed or answered whole."""
        params = self._search_params(params, search)
        count = 1 if search.beam else max(search.n, search.best_of)
        grammars = await self._grammars(params, count)
        ids, queue = self._start(
            prompt, params, search.n, search.best_of, search.beam, body.priority, grammars
        )
        items = self._items(ids, queue)
        shapes = self._shapes(body, spec)
        if body.stream:
            finished: list[RequestOutput] = []

            def record(tag: int, out: RequestOutput) -> None:
                if out.finished:
                    finished.append(out)

            chunks = responses.stream_chunks(
                shapes, ids[0], items, lambda: self._usage(prompt, finished), echo, record
            )
            return await responses.stream_response(
                chunks, items, refused=(ValueError,), failed=(async_engine.RequestFailed,)
            )
        finals = self._choose(await self._collect(items, request), search)
        return shapes.response(
            ids[0],
            [responses.Final(out.text, out.finish_reason, lps) for out, lps in finals],
            self._usage(prompt, [out for out, _ in finals]),
            echo,
        )

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

        await requests.until_disconnected(gather(), request, close)
        return [(finals[i], logprobs.get(i, [])) for i in sorted(finals)]

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
        return responses.usage(len(prompt), completion, cached)
