"""One error layer for the runtimes' FastAPI servers (cloud and edge).

Every answer that is not a success has the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``, whatever raised it:

- :class:`~hybridllm_common.openai_protocol.APIError`: its stable code and status;
- a request body that fails validation: 400 ``invalid_parameter`` naming the parameter;
- an unknown path or method: 404 ``not_found`` / 405 ``method_not_allowed`` (FastAPI's
  own ``{"detail": "Not Found"}`` would break clients that parse errors);
- a body over ``MAX_BODY_BYTES``: 400 ``invalid_request`` (:class:`BodyLimit`);
- a request without the gateway's token, where one is configured: 401 ``unauthorized``
  (:class:`RequireBackendToken`);
- anything else: 500 ``internal_error`` carrying a request id, never the exception's text
  (which can hold paths, prompts or other tenants' data); the log has the traceback
  under the same id. The id is the client's ``x-request-id`` when it sent one.

FastAPI is imported by the servers that use this module, not by ``hybridllm_common``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from hybridllm_common import backend_auth
from hybridllm_common import openai_protocol as oai

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


def error_response(
    code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    status, body = oai.make_error(code, message, param)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def request_id(request: Request) -> str:
    sent = request.headers.get(REQUEST_ID_HEADER, "")
    return sent[:128] if sent.isprintable() and sent else oai.new_id("req")


MAX_BODY_BYTES = 4 << 20  # a request body past it is refused (the gateway's cap is 1 MiB)


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 400 ``invalid_request``,
    whether announced by Content-Length (refused before a byte is read) or sent chunked
    (refused as the count passes the cap: the rest is never read). Without it a runtime
    read any body whole into memory, for whoever reaches it."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse()(scope, receive, send)
            return
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise oai.APIError(oai.INVALID_REQUEST, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body is over {self.max_bytes} bytes"

    def _refuse(self) -> JSONResponse:
        return error_response(oai.INVALID_REQUEST, self._message())


class RequireBackendToken:
    """ASGI middleware: every path but the probes' and Prometheus' answers 401 without the
    gateway's token (:mod:`hybridllm_common.backend_auth`), before the body is read."""

    def __init__(self, app: Any, token: str, on_reject: Callable[[str], None]) -> None:
        self.app, self.token, self.on_reject = app, token, on_reject

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in backend_auth.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if backend_auth.matches(self.token, dict(scope.get("headers") or ()).get(b"authorization")):
            await self.app(scope, receive, send)
            return
        self.on_reject(oai.UNAUTHORIZED)
        refusal = error_response(
            oai.UNAUTHORIZED,
            "this runtime answers its gateway only: send requests to the service's gateway",
        )
        await refusal(scope, receive, send)


def install(
    app: FastAPI, on_reject: Callable[[str], None], max_body_bytes: int = MAX_BODY_BYTES
) -> None:
    """Register the handlers and the body limit; ``on_reject(code)`` counts every error
    answer (metrics). Where a backend token is configured, only requests carrying it are
    served (a misconfigured one raises :class:`backend_auth.TokenError`)."""
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    token = backend_auth.load_token()
    if token is not None:
        # added last, so it runs first: a refused request's body is never read
        app.add_middleware(RequireBackendToken, token=token, on_reject=on_reject)

    @app.exception_handler(oai.APIError)
    async def _api_error(request: Request, exc: oai.APIError) -> JSONResponse:
        on_reject(exc.code)
        return error_response(exc.code, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = oai.validation_error_param(tuple(first.get("loc", ())))
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        on_reject(oai.INVALID_PARAMETER)
        return error_response(oai.INVALID_PARAMETER, msg, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: oai.NOT_FOUND, 405: oai.METHOD_NOT_ALLOWED}.get(
            exc.status_code, oai.INVALID_REQUEST
        )
        message = {
            404: f"no route {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        on_reject(code)
        status, body = oai.make_error(code, message)
        return JSONResponse(
            body.model_dump(), status_code=exc.status_code or status, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        rid = request_id(request)
        log.error("request %s failed", rid, exc_info=exc)
        on_reject(oai.INTERNAL_ERROR)
        return error_response(
            oai.INTERNAL_ERROR,
            f"internal error (request id {rid}); the server log has the details",
            headers={REQUEST_ID_HEADER: rid},
        )


class _ProbeAccessFilter(logging.Filter):
    """Drops uvicorn's access-log lines for ``GET /health``: a kubelet (or the local
    supervisor) probes every few seconds, and those lines would bury the requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and args[2] == "/health")


TLS_RELOAD_S = 30.0  # how often a served certificate file is looked at for a new one


def run_server(
    app: FastAPI, host: str, port: int, certfile: str | None = None, keyfile: str | None = None
) -> None:
    """Serve a runtime's app with uvicorn, as both runtimes do; over TLS with a certificate
    (TLS 1.3; the files are loaded again when the certificate's changes: a device agent
    renews it while its runtime serves)."""
    import uvicorn

    logging.getLogger("uvicorn.access").addFilter(_ProbeAccessFilter())
    if certfile is None or keyfile is None:
        uvicorn.run(app, host=host, port=port, log_level="info")
        return
    import ssl
    import threading

    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            ssl_certfile=certfile, ssl_keyfile=keyfile)  # fmt: skip
    config.load()  # its SSLContext, made once; the server below serves with it
    context = config.ssl
    assert context is not None
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    threading.Thread(target=_reload_certificate, args=(context, certfile, keyfile),
                     daemon=True, name="tls-reload").start()  # fmt: skip
    uvicorn.Server(config).run()


def _reload_certificate(
    context: Any, certfile: str, keyfile: str, interval: float = TLS_RELOAD_S,
    stop: Any = None,
) -> None:  # fmt: skip
    """Load a renewed certificate into the serving context (new connections get it), until
    ``stop`` (a threading.Event) is set."""
    import os
    import threading

    def stamp() -> tuple[int, int, int]:  # a rename of a new file changes the inode
        try:
            st = os.stat(certfile)
        except OSError:
            return (0, 0, 0)
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    stop = stop or threading.Event()
    seen = stamp()
    while not stop.wait(interval):
        now = stamp()
        if now != seen:
            try:
                context.load_cert_chain(certfile, keyfile)
                seen = now
                log.info("loaded the renewed certificate %s", certfile)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                log.error("the certificate %s could not be loaded (still serving the old "
                          "one): %s", certfile, exc)  # fmt: skip
