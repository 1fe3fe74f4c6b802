"""A small real OpenAI-compatible HTTP server that streams tokens at a fixed rate.

It is the backend of the gateway's tests and benchmark where no runtime is needed: the
same routes and error shape as the runtimes, requests validated by the shared OpenAI
models, ``max_tokens`` tokens (default 16) sent ``1/rate`` seconds apart after
``ttft_s``. Every answer names the server in ``system_fingerprint`` (so tests can see
which replica answered), and ``/stats`` counts requests, completed and cancelled streams
(a client that disconnects shows up as cancelled). ``--mean-logprob`` sets the logprob of
every token when logprobs are asked for (the cascade's confidence signal), and
``--fail-status`` makes every completion answer that HTTP status (with ``--retry-after``
S, a Retry-After header: a runtime whose queue is full); ``--echo`` answers
with the prompt it received (to see what the gateway sent upstream).

``--prefill-rate`` makes the first token wait for the prompt, and ``--slowdown-s`` makes
each token wait longer for every other stream in flight (a batch's step): a replica of
known speed, for `hybridllm profile`'s test. With ``--serial-prefill`` the replica is an
engine without chunked prefill: one prompt is prefilled at a time and every stream's
decoding stops while it is (the capacity model's replica: ``prompt / prefill rate +
output / decode rate`` of its time per request, see hybridllm_forecaster.capacity).

Two flags make it a replica with a capacity, for the autoscaling benchmark:
``--max-concurrency N`` answers at most N requests at once and queues the rest in arrival
order (a runtime's batch slots: the wait shows in the time to first token, and ``/stats``
counts ``waiting``); ``--startup-s S`` answers 503 ("loading", with Retry-After) on
``/health`` and the completion routes for S seconds after it starts (a model load).

``python bench/tokenserver.py --port 9001 --id a --rate 100`` (from the repository root). It
is a test and benchmark double, not part of any shipped package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from hybridllm_common import openai_protocol as oai

log = logging.getLogger(__name__)
STATS = web.AppKey("stats", dict)
OPTS = web.AppKey("opts", argparse.Namespace)
SLOTS = web.AppKey("slots", object)  # asyncio.Semaphore, or None: no limit
LOADED_AT = web.AppKey("loaded_at", float)  # time.monotonic() once the "model" is loaded


class Engine:
    """One prefill at a time, and no stream decodes while one runs (--serial-prefill)."""

    def __init__(self) -> None:
        self.prefilling = asyncio.Lock()
        self.decoding = asyncio.Event()
        self.decoding.set()

    async def prefill(self, seconds: float) -> None:
        async with self.prefilling:
            self.decoding.clear()
            try:
                await asyncio.sleep(seconds)
            finally:
                self.decoding.set()


ENGINE = web.AppKey("engine", Engine)  # the --serial-prefill replica's one prefill


def _error(code: str, message: str, param: str | None = None) -> web.Response:
    status, body = oai.make_error(code, message, param)
    return web.json_response(body.model_dump(), status=status)


def _parse(
    raw: bytes, model_cls: type[BaseModel]
) -> tuple[dict[str, Any] | None, web.Response | None]:
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return None, _error(oai.INVALID_REQUEST, "the body must be a JSON object")
        model_cls.model_validate(body)
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            param = oai.validation_error_param(tuple(first.get("loc", ())))
            return None, _error(oai.INVALID_PARAMETER, f"{param}: {first.get('msg')}", param)
        return None, _error(oai.INVALID_REQUEST, f"not JSON: {exc}")
    return body, None


def _loading(app: web.Application) -> web.Response | None:
    """503 while the startup delay runs (what a runtime answers while it loads)."""
    left = app[LOADED_AT] - time.monotonic()
    if left <= 0:
        return None
    resp = _error(oai.MODEL_NOT_READY, f"loading: ready in {left:.1f} s")
    resp.headers["Retry-After"] = str(max(1, round(left)))
    return resp


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    stats = request.app[STATS]
    stats["requests"] += 1
    loading = _loading(request.app)
    if loading is not None:
        return loading
    slots = request.app[SLOTS]
    if slots is None:
        return await _answer(request, chat)
    stats["waiting"] += 1
    try:
        await slots.acquire()
    finally:
        stats["waiting"] -= 1
    try:
        return await _answer(request, chat)
    finally:
        slots.release()


async def _answer(request: web.Request, chat: bool) -> web.StreamResponse:
    opts, stats = request.app[OPTS], request.app[STATS]
    body, err = _parse(
        await request.read(), oai.ChatCompletionRequest if chat else oai.CompletionRequest
    )
    if err is not None:
        return err
    assert body is not None
    if opts.fail_status:
        resp = _error(
            oai.SERVER_OVERLOADED if opts.fail_status == 503 else oai.INTERNAL_ERROR,
            "injected failure",
        )
        if opts.retry_after:
            resp.headers["Retry-After"] = str(opts.retry_after)
        return resp
    n = body.get("max_completion_tokens") or body.get("max_tokens") or opts.default_tokens
    n = min(int(n), opts.max_tokens)
    model = body.get("model") or opts.model
    want_lp = bool(body.get("logprobs")) or body.get("logprobs") == 0
    rid = oai.new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    interval = 1.0 / opts.rate + opts.slowdown_s * stats["in_flight"]  # others in flight
    prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
    prefill_s = prompt_tokens / opts.prefill_rate if opts.prefill_rate else 0.0
    engine = request.app[ENGINE] if opts.serial_prefill else None
    if engine is not None:  # the prompt's time is the engine's, not this request's alone
        ttft_s = opts.ttft_s
        await engine.prefill(prefill_s)
    else:
        ttft_s = opts.ttft_s + prefill_s
    if not body.get("stream"):
        await asyncio.sleep(ttft_s + interval * (n - 1))
        text = opts.token * n
        if opts.echo:
            text = json.dumps(body.get("messages") or body.get("prompt"))
        lp_chat = {
            "content": [{"token": opts.token, "logprob": opts.mean_logprob, "top_logprobs": []}] * n
        }
        lp_cmpl = {"tokens": [opts.token] * n, "token_logprobs": [opts.mean_logprob] * n}
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        if want_lp:
            choice["logprobs"] = lp_chat if chat else lp_cmpl
        stats["completed"] += 1
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "system_fingerprint": opts.id,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n},
        })  # fmt: skip
    if chat:
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": opts.id,
        }
        delta = {"content": opts.token}
        tok = json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        last = json.dumps(
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        )
    else:
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": opts.id,
        }
        tok = json.dumps(
            {**head, "choices": [{"index": 0, "text": opts.token, "finish_reason": None}]}
        )
        # a completion stream's last token carries the finish (as vLLM's and ours do); a
        # chat stream ends with OpenAI's empty-delta finish chunk
        last = json.dumps(
            {**head, "choices": [{"index": 0, "text": opts.token, "finish_reason": "length"}]}
        )
    usage = ""
    if (body.get("stream_options") or {}).get("include_usage"):
        counts = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                  "total_tokens": prompt_tokens + n}  # fmt: skip
        usage = f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n"
    tok_b = f"data: {tok}\n\n".encode()
    last_b = f"data: {last}\n\n{usage}data: [DONE]\n\n".encode()
    resp = web.StreamResponse(
        headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
    )
    stats["in_flight"] += 1
    try:
        await resp.prepare(request)
        await asyncio.sleep(ttft_s)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(n if chat else n - 1):
            if engine is not None:  # a token a step, the steps held while a prompt prefills
                if i:
                    await asyncio.sleep(interval)
                await engine.decoding.wait()
            elif i:
                await asyncio.sleep(max(0.0, t0 + i * interval - loop.time()))
            await resp.write(tok_b)
        if not chat and n > 1:
            await asyncio.sleep(max(0.0, t0 + (n - 1) * interval - loop.time()))
        await resp.write(last_b)
        if opts.hold_end_s:  # the answer's last event sent, the end of the body held back
            await asyncio.sleep(opts.hold_end_s)
        stats["completed"] += 1
    except (asyncio.CancelledError, ConnectionResetError, RuntimeError):
        stats["cancelled"] += 1
        raise
    finally:
        stats["in_flight"] -= 1
    return resp


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, False)


def create_app(opts: argparse.Namespace) -> web.Application:
    app = web.Application()
    app[OPTS] = opts
    app[STATS] = {"requests": 0, "completed": 0, "cancelled": 0, "in_flight": 0, "waiting": 0}
    app[SLOTS] = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    app[LOADED_AT] = time.monotonic() + opts.startup_s
    app[ENGINE] = Engine()

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**request.app[STATS], "id": opts.id})

    async def health(request: web.Request) -> web.Response:
        return _loading(request.app) or web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response(oai.ModelList(data=[oai.ModelCard(id=opts.model)]).model_dump())

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    return app


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/tokenserver.py", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--id", default="tokenserver")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rate", type=float, default=100.0, help="tokens per second per stream")
    p.add_argument("--ttft-s", type=float, default=0.0)
    p.add_argument(
        "--prefill-rate", type=float, default=0.0,
        help="prompt tokens per second added to the first token's time (0: none)",
    )  # fmt: skip
    p.add_argument(
        "--serial-prefill", action="store_true",
        help="prefill one prompt at a time and hold every stream's decoding meanwhile",
    )  # fmt: skip
    p.add_argument(
        "--slowdown-s", type=float, default=0.0,
        help="seconds each other stream in flight adds between tokens (a batch's step)",
    )  # fmt: skip
    p.add_argument("--default-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--token", default=" tok")
    p.add_argument("--mean-logprob", type=float, default=-0.1)
    p.add_argument("--fail-status", type=int, default=0)
    p.add_argument(
        "--retry-after", type=_non_negative_int, default=0,
        help="with --fail-status: send this Retry-After (a runtime whose queue is full)",
    )  # fmt: skip
    p.add_argument("--echo", action="store_true", help="answer with the prompt (non-streaming)")
    p.add_argument(
        "--max-concurrency", type=_non_negative_int, default=0,
        help="answer at most this many requests at once, queue the rest (0: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--hold-end-s", type=float, default=0.0,
        help="after a stream's last event (data: [DONE]), wait this long before ending the body",
    )  # fmt: skip
    p.add_argument(
        "--startup-s", type=float, default=0.0,
        help="answer 503 (loading) for this long after starting, as a runtime loading a model",
    )  # fmt: skip
    return p


def run(opts: argparse.Namespace) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        log.info("uvloop not installed; using the default event loop")
    web.run_app(create_app(opts), host=opts.host, port=opts.port, print=None, access_log=None,
                handler_cancellation=True, backlog=4096)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run(parser().parse_args()))
