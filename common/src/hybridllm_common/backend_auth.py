"""The token a gateway shows its runtimes, so that a runtime answers its gateway only.

A runtime is where a request is cheapest to abuse: behind the gateway there are no API
keys, rate limits, safety filter or tenant salt. Where a token is configured, every runtime
(cloud and edge, :func:`hybridllm_common.http_errors.install`) answers ``/v1/...`` only to a
request that carries ``Authorization: Bearer <token>``, and only such a request may set
``cache_salt`` (the gateway sets it per tenant); ``/health`` and ``/metrics`` stay open to
probes and Prometheus. The gateway sends the token to every backend it forwards to.

Where the token comes from, in order: the file named by ``HYBRIDLLM_BACKEND_TOKEN_FILE`` (a
mounted Secret: the operator makes one per LLMService), or ``HYBRIDLLM_BACKEND_TOKEN`` (local
mode hands each child its service's token this way). Neither set: the runtime is open, as a
standalone ``hybridllm edge serve`` or ``cloud serve`` is.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

TOKEN_ENV = "HYBRIDLLM_BACKEND_TOKEN"
TOKEN_FILE_ENV = "HYBRIDLLM_BACKEND_TOKEN_FILE"
SECRET_KEY = "token"  # the key of the operator's Secret that holds it
MIN_LENGTH = 32
OPEN_PATHS = frozenset({"/health", "/metrics"})


class TokenError(ValueError):
    """A token that is configured but unusable (missing file, empty, too short)."""


def new_token() -> str:
    """A fresh token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def load_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The configured token, or None where none is; a bad one raises :class:`TokenError`
    (a runtime that meant to be closed must not start open)."""
    env = os.environ if environ is None else environ
    path = env.get(TOKEN_FILE_ENV, "")
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"{TOKEN_FILE_ENV}={path}: {exc.strerror or exc}") from exc
        where = f"{TOKEN_FILE_ENV}={path}"
    else:
        token, where = env.get(TOKEN_ENV, "").strip(), TOKEN_ENV
        if not token:
            return None
    if len(token) < MIN_LENGTH or not token.isprintable() or " " in token:
        raise TokenError(f"{where}: a backend token is at least {MIN_LENGTH} printable "
                         "characters without spaces")  # fmt: skip
    return token


def header(token: str) -> dict[str, str]:
    """The header a gateway sends with every forwarded request."""
    return {"authorization": f"Bearer {token}"}


def matches(expected: str, authorization: bytes | str | None) -> bool:
    """Whether an ``Authorization`` header value carries ``expected`` (constant time)."""
    if authorization is None:
        return False
    got = authorization.encode() if isinstance(authorization, str) else authorization
    return hmac.compare_digest(got, f"Bearer {expected}".encode())
