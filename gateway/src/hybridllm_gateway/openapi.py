"""The gateway's OpenAPI document, built from the shared OpenAI models (for clients and
for schemathesis, which the tests run against it)."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from hybridllm_common import openai_protocol as oai

REF = "#/components/schemas/{model}"


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}},
    }


def _post(request: str, response: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": REF.format(model=request)}}},
            },
            "responses": {
                "200": {
                    "description": "The answer (text/event-stream when stream is true).",
                    "content": {
                        "application/json": {"schema": {"$ref": REF.format(model=response)}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                "400": _error("Invalid request, or blocked by the content filter."),
                "401": _error("Missing or invalid API key."),
                "404": _error("Unknown model."),
                "429": _error("Rate limit exceeded; see Retry-After."),
                "502": _error("No upstream replica answered."),
            },
        }
    }


@cache
def spec() -> dict[str, Any]:
    models = [
        (oai.ChatCompletionRequest, "validation"),
        (oai.CompletionRequest, "validation"),
        (oai.ChatCompletionResponse, "serialization"),
        (oai.CompletionResponse, "serialization"),
        (oai.ModelList, "serialization"),
        (oai.ErrorResponse, "serialization"),
    ]
    _, schemas = models_json_schema(models, ref_template=REF)  # type: ignore[arg-type]
    return {
        "openapi": "3.1.0",
        "info": {"title": "hybridllm gateway", "version": "0.1.0"},
        "paths": {
            "/v1/chat/completions": _post(
                "ChatCompletionRequest", "ChatCompletionResponse", "Chat completion"
            ),
            "/v1/completions": _post("CompletionRequest", "CompletionResponse", "Completion"),
            "/v1/models": {
                "get": {
                    "summary": "Models served",
                    "responses": {
                        "200": {
                            "description": "The model and its per-tier names.",
                            "content": {
                                "application/json": {
                                    "schema": {"$ref": REF.format(model="ModelList")}
                                }
                            },
                        }
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Whether some backend replica is healthy",
                    "responses": {
                        "200": {"description": "ok"},
                        "503": _error("No healthy backend."),
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: the gateway takes requests (whatever its backends)",
                    "responses": {"200": {"description": "ok"}},
                }
            },
        },
        "components": {"schemas": schemas.get("$defs", {})},
    }
