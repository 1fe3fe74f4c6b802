"""One error type for the gateway, rendered in the runtimes' OpenAI error shape."""

from __future__ import annotations

import json

from aiohttp import web

from hybridllm_common import openai_protocol as oai


class APIError(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.headers = code, message, param, headers


def error_response(
    code: str, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    status, body = oai.make_error(code, message, param)
    return web.Response(
        body=json.dumps(body.model_dump()).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )
