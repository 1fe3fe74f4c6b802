"""``POST /v1/search``: verifier-guided step-level search (``search/step_search.py``) over HTTP.

The request names a problem (``prompt``, or chat ``messages`` through the model's chat
template) and the search: candidates per path (``num_candidates``), paths kept
(``beam_width``), rounds (``max_steps``), step and path token caps, step delimiters, end
stops, sampling, and the verifier's ``prompt`` / ``target`` / ``aggregate``. The generator
is the served model; the verifier is the model of ``--verifier-model`` (or the served
model's first ``--verifier-num-layers`` layers) in this process, with its share of the KV
budget, or, by default, the served model itself scoring in the same engine and cache.

The search's calls run on the engine threads like any other request (they batch with
chat and completion traffic and are preempted like it); a client that goes away aborts
the calls in flight. The answer lists the ``n`` best paths with their steps and scores,
``usage`` as OpenAI counts it (the prompt, and the returned paths' tokens), and
``compute``: the tokens each model computed for the whole search, the measure at which
strategies are compared at equal compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hybridllm_cloud.engine import async_engine
from hybridllm_cloud.engine.llm_engine import RequestOutput
from hybridllm_cloud.engine.request import Priority
from hybridllm_cloud.search import step_search
from hybridllm_common import openai_protocol as oai
from hybridllm_common import tool_calls
from hybridllm_common.serving import requests

if TYPE_CHECKING:
    from hybridllm_cloud.server.serving import Serving


class VerifierSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(
        default=None, description="the verifier's context, with {steps} and optionally {problem}"
    )
    target: str | None = Field(
        default=None,
        description="score log P(target | context with the candidate); default: the "
        "candidate step's mean token log-likelihood",
    )
    aggregate: Literal["mean", "min", "last"] = "mean"


class SearchRequest(oai.StopField):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    prompt: str | None = Field(default=None, min_length=1)
    messages: list[oai.ChatMessage] | None = Field(default=None, min_length=1)
    num_candidates: int = Field(default=4, ge=1, le=step_search.MAX_CANDIDATES)
    beam_width: int = Field(default=2, ge=1, le=step_search.MAX_BEAM_WIDTH)
    n: int = Field(default=1, ge=1)
    max_steps: int = Field(default=16, ge=1, le=256)
    max_step_tokens: int = Field(default=64, ge=1)
    max_tokens: int = Field(default=256, ge=1)
    step_delimiters: list[str] = Field(default_factory=lambda: ["\n"], min_length=1, max_length=4)
    temperature: float = Field(default=0.8, gt=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    verifier: VerifierSpec = Field(default_factory=VerifierSpec)
    priority: Literal["interactive", "batch"] = "interactive"

    @model_validator(mode="after")
    def _one_problem(self) -> SearchRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def params(self) -> step_search.StepSearchParams:
        return step_search.StepSearchParams(
            num_candidates=self.num_candidates,
            beam_width=self.beam_width,
            max_steps=self.max_steps,
            max_step_tokens=self.max_step_tokens,
            max_tokens=self.max_tokens,
            step_delimiters=tuple(self.step_delimiters),
            stop=tuple(self.stop_list()),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            n=self.n,
            aggregate=self.verifier.aggregate,
            verifier_prompt=self.verifier.prompt,
            verifier_target=self.verifier.target,
        )


class SearchChoice(BaseModel):
    index: int
    text: str
    steps: list[str]
    step_scores: list[float]
    score: float
    finish_reason: str


class SearchCompute(BaseModel):
    generator_tokens: int
    verifier_tokens: int
    total_tokens: int
    generated_tokens: int
    generator_calls: int
    verifier_calls: int
    rounds: int


class SearchResponse(BaseModel):
    id: str
    object: Literal["search"] = "search"
    created: int
    model: str
    choices: list[SearchChoice]
    usage: oai.Usage
    compute: SearchCompute


async def run_calls(
    engine: async_engine.AsyncEngine,
    calls: Sequence[step_search.Generate | step_search.Score],
    priority: Priority,
) -> list[RequestOutput]:
    """Runs a round's calls on one engine; returns each call's final output, in order
    (prompt logprobs, which come with a request's first output, carried onto it). Calls
    still running when this is cancelled or fails are aborted."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
    base = oai.new_id("search")
    ids = [f"{base}-{i}" for i in range(len(calls))]
    for i, call in enumerate(calls):
        engine.add(ids[i], call.prompt_token_ids, call.params, priority, queue, tag=i)
    finals: dict[int, RequestOutput] = {}
    first: dict[int, RequestOutput] = {}
    ended: set[int] = set()  # finished or failed: nothing to abort
    try:
        while len(finals) < len(calls):
            tag, item = await queue.get()
            if isinstance(item, BaseException):
                ended.add(tag)
                raise item
            first.setdefault(tag, item)
            if item.finished:
                finals[tag] = item
                ended.add(tag)
    finally:
        for tag, request_id in enumerate(ids):
            if tag not in ended:
                engine.abort(request_id)
    outs = []
    for i in range(len(calls)):
        out = finals[i]
        if out.prompt_logprobs is None:
            out.prompt_logprobs = first[i].prompt_logprobs
        outs.append(out)
    return outs


async def run_search(
    problem: step_search.Problem,
    params: step_search.StepSearchParams,
    generator: async_engine.AsyncEngine,
    verifier: async_engine.AsyncEngine | None,
    verifier_tokenizer: step_search.TextTokenizer | None,
    priority: Priority,
) -> step_search.SearchResult:
    """The search on the engine threads (``verifier`` None: scored by the generator)."""
    tokenizer = generator.engine.tokenizer
    assert tokenizer is not None
    run = step_search.search(problem, params, tokenizer, verifier_tokenizer, verifier is not None)
    calls = next(run)
    while True:
        is_gen = bool(calls) and isinstance(calls[0], step_search.Generate)
        engine = generator if is_gen or verifier is None else verifier
        outs = await run_calls(engine, calls, priority)
        try:
            calls = run.send(outs)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


async def handle(serving: Serving, body: SearchRequest, request: Request) -> JSONResponse:
    """The endpoint: admission (400 naming the field, 503 + Retry-After when queued work is
    at its bound), the search raced against the client's disconnect, the answer."""
    app = serving.app
    serving._check_ready(body.model)
    params = body.params()
    try:
        params.validate()
    except ValueError as exc:
        param = str(exc).split(":", 1)[0]
        raise serving.error(oai.INVALID_PARAMETER, str(exc), param) from exc
    tok = serving.tokenizer
    if body.messages is not None:
        plan = tool_calls.ChatPlan(
            tool_calls.chat_messages(body.messages, None, False), None, None, None
        )
        text = serving.chat_text(plan)
        user = [m.text() for m in body.messages if m.role == "user"]
        problem = step_search.Problem(
            tok.encode(text, add_special_tokens=False), text, user[-1] if user else text, True
        )
    else:
        assert body.prompt is not None
        problem = step_search.Problem(tok.encode(body.prompt), body.prompt, body.prompt)
    where = "messages" if body.messages is not None else "prompt"
    if len(problem.token_ids) + params.max_tokens > serving.max_len:
        raise serving.error(
            oai.CONTEXT_LENGTH_EXCEEDED,
            f"prompt ({len(problem.token_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
            f"context length {serving.max_len}",
            where if len(problem.token_ids) >= serving.max_len else "max_tokens",
        )
    serving.check_capacity()
    verifier = app.state.verifier
    prio = Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE
    result = await requests.until_disconnected(
        run_search(
            problem,
            params,
            serving.engine,
            verifier.engine if verifier is not None else None,
            verifier.tokenizer if verifier is not None else None,
            prio,
        ),
        request,
    )
    metrics = serving.metrics
    metrics.searches.inc()
    metrics.search_tokens.labels(model="generator").inc(result.compute.generator_tokens)
    metrics.search_tokens.labels(model="verifier").inc(result.compute.verifier_tokens)
    completion = sum(len(p.token_ids) for p in result.paths)
    c = result.compute
    resp = SearchResponse(
        id=oai.new_id("search"),
        created=int(time.time()),
        model=app.state.model_name,
        choices=[
            SearchChoice(
                index=i,
                text=text,
                steps=path.steps,
                step_scores=path.step_scores,
                score=score,
                finish_reason=path.finish_reason or "length",
            )
            for i, (path, text, score) in enumerate(
                zip(result.paths, result.texts, result.scores, strict=True)
            )
        ],
        usage=oai.Usage(
            prompt_tokens=len(problem.token_ids),
            completion_tokens=completion,
            total_tokens=len(problem.token_ids) + completion,
        ),
        compute=SearchCompute(
            generator_tokens=c.generator_tokens,
            verifier_tokens=c.verifier_tokens,
            total_tokens=c.total_tokens,
            generated_tokens=c.generated_tokens,
            generator_calls=c.generator_calls,
            verifier_calls=c.verifier_calls,
            rounds=result.num_rounds,
        ),
    )
    return JSONResponse(resp.model_dump(exclude_none=True))
