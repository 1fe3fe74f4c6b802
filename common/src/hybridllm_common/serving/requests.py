"""The request half of serving a completion, the same in both runtimes.

A request is checked (the model is loaded and is the one asked for, the engine's queue is
under its bound), its prompt and sampling fields read, its grammars built, and its ``n``
choices run as engine requests whose outputs arrive, tagged by choice index, on one
asyncio queue (:func:`outputs`). A client that goes away aborts every engine request it
started: a stream through the generator's ``finally``, a non-streaming answer through
:func:`until_disconnected`. Every check raises
:class:`hybridllm_common.openai_protocol.APIError`, which the error layer renders.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from hybridllm_common import admission, structured
from hybridllm_common import openai_protocol as oai
from hybridllm_common.serving import metrics as metrics_mod

Body = oai.ChatCompletionRequest | oai.CompletionRequest
OutputT = TypeVar("OutputT", bound=metrics_mod.Output)
ParamsT = TypeVar("ParamsT")
T = TypeVar("T")


def check_ready(app: FastAPI) -> None:
    """503 ``model_not_ready`` (with the reason) until the model is loaded."""
    if not app.state.ready:  # no engine yet, or none at all (the model was refused)
        raise oai.APIError(oai.MODEL_NOT_READY, app.state.not_ready_reason)


def check_model(app: FastAPI, model: str) -> None:
    """404 ``model_not_found`` when the request names another model than the served one."""
    if model and model != app.state.model_name:
        raise oai.APIError(oai.MODEL_NOT_FOUND, f"model {model!r} is not served here", "model")


def check_capacity(app: FastAPI, num_waiting: int) -> None:
    """503 with Retry-After when the engine's queue is at its bound."""
    settings = app.state.settings
    if num_waiting >= settings.max_waiting_requests:
        raise oai.APIError(
            oai.SERVER_OVERLOADED,
            "too many queued requests, retry later",
            None,
            {"Retry-After": str(settings.retry_after_seconds)},
        )


def completion_prompt(
    body: oai.CompletionRequest, encode: Callable[[str], list[int]], vocab_size: int
) -> tuple[str | None, list[int]]:
    """A completion's prompt: its text (None when sent as token ids) and its token ids."""
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
        if len(body.prompt) != 1:
            raise oai.APIError(oai.INVALID_PARAMETER, "prompt: one prompt per request", "prompt")
        text: str | None = str(body.prompt[0])
    else:
        text = body.prompt if isinstance(body.prompt, str) else None
    if text is not None:
        return text, encode(text)
    return None, admission.prompt_token_ids(body.prompt, vocab_size)


def render_chat(render: Callable[[], str]) -> str:
    """The chat template's text (a 400 naming ``messages`` when the template refuses them)."""
    try:
        return render()
    except Exception as exc:
        raise oai.APIError(oai.INVALID_REQUEST, f"chat template: {exc}", "messages") from exc


def sampling_fields(
    body: Body, prompt_len: int, max_model_len: int, logprobs: int | None
) -> dict[str, Any]:
    """The sampling parameters both engines take, from the request (``max_tokens`` checked
    against the context length)."""
    return dict(
        max_tokens=admission.max_new_tokens(body, prompt_len, max_model_len),
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


def choice_params(params: ParamsT, index: int) -> ParamsT:
    """Choice ``index``'s sampling parameters: a seeded request's choices differ by seed."""
    seed = getattr(params, "seed", None)
    if seed is None or not index:
        return params
    return dataclasses.replace(params, seed=seed + index)  # type: ignore[type-var]


def request_ids(n: int) -> list[str]:
    """The engine request ids of a request's ``n`` choices (one base id, choice suffixes)."""
    base = oai.new_id("req")
    return [f"{base}-{i}" for i in range(n)]


async def grammars(
    vocabulary: Callable[[], structured.Vocabulary],
    constraint: structured.Constraint | None,
    count: int,
    metrics: metrics_mod.ServerMetrics,
) -> list[structured.Matcher | None]:
    """One matcher per engine request (``structured.matchers``: checked and built off the
    event loop and the engine's step loop)."""
    if constraint is None:
        return [None] * count
    built = await structured.matchers(vocabulary, constraint, count)
    metrics.structured.labels(kind=constraint.kind).inc()
    return list(built)


async def outputs(
    ids: list[str],
    queue: asyncio.Queue[tuple[int, OutputT | BaseException]],
    abort: Callable[[str], None],
    metrics: metrics_mod.ServerMetrics,
    clock_per_choice: bool = True,
) -> AsyncIterator[tuple[int, OutputT]]:
    """Outputs of all choices until each finished, timed (one clock per choice, or one
    for the whole request); an engine error is raised; the rest are aborted if left early."""
    open_tags = set(range(len(ids)))
    if clock_per_choice:
        timings = [metrics_mod.Timing() for _ in ids]
    else:
        timings = [metrics_mod.Timing()] * len(ids)
    try:
        while open_tags:
            tag, item = await queue.get()
            if isinstance(item, BaseException):
                open_tags.discard(tag)
                raise item
            metrics.on_output(timings[tag], item)
            if item.finished:
                open_tags.discard(tag)
            yield tag, item
    finally:
        for tag in open_tags:
            abort(ids[tag])


async def until_disconnected(
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
        raise oai.APIError(oai.INVALID_REQUEST, "client disconnected")
    return task.result()  # re-raises an engine error
