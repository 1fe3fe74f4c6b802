"""One error type for the gateway, rendered in the runtimes' OpenAI error shape."""

from __future__ import annotations

import json

from aiohttp import web

from hybridllm_common import openai_protocol as oai

APIError = oai.APIError


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
