"""A runtime with a backend token answers its gateway only (hybridllm_common.backend_auth and
the error layer both runtimes install). The real runtimes are checked end to end in
tests/hybridllm_operator/test_local_e2e.py (the supervisor's token)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from hybridllm_common import backend_auth, http_errors

TOKEN = "k" * 43


def _app(rejected: list[str]) -> FastAPI:
    app = FastAPI()
    http_errors.install(app, rejected.append, max_body_bytes=1024)
    read: list[int] = []
    app.state.read = read

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, int]:
        read.append(len(await request.body()))
        return {"ok": 1}

    return app


def test_only_the_gateways_token_opens_the_api_and_probes_stay_open(monkeypatch) -> None:
    monkeypatch.setenv(backend_auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(backend_auth.TOKEN_FILE_ENV, raising=False)
    rejected: list[str] = []
    app = _app(rejected)
    client = TestClient(app)
    body = {"prompt": "x" * 100}
    for headers in ({}, {"authorization": "Bearer " + "k" * 42}, {"authorization": TOKEN}):
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized"
        assert "answers its gateway only" in r.json()["error"]["message"]
    # a refused body is never read, not even past the body limit
    big = client.post("/v1/completions", content=b"x" * 4096)
    assert big.status_code == 401
    assert app.state.read == []
    assert rejected == ["unauthorized"] * 4
    ok = client.post("/v1/completions", json=body, headers=backend_auth.header(TOKEN))
    assert ok.status_code == 200
    assert app.state.read == [len(ok.request.content)]
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    # and an unknown path is refused before it is found missing (nothing to probe)
    assert client.get("/v1/search").status_code == 401


def test_without_a_token_the_runtime_is_open_and_a_bad_one_does_not_start(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(backend_auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(backend_auth.TOKEN_FILE_ENV, raising=False)
    client = TestClient(_app([]))
    assert client.post("/v1/completions", json={}).status_code == 200
    # the file (a mounted Secret) wins over the variable
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert backend_auth.load_token({backend_auth.TOKEN_FILE_ENV: str(secret),
                                    backend_auth.TOKEN_ENV: "x" * 40}) == TOKEN  # fmt: skip
    for environ, message in (
        ({backend_auth.TOKEN_ENV: "short"}, "at least 32"),
        ({backend_auth.TOKEN_ENV: "has a space " * 4}, "without spaces"),
        ({backend_auth.TOKEN_FILE_ENV: str(tmp_path / "missing")}, "No such file"),
        ({backend_auth.TOKEN_FILE_ENV: str(tmp_path)}, "Is a directory"),
    ):
        with pytest.raises(backend_auth.TokenError, match=message):
            backend_auth.load_token(environ)
    monkeypatch.setenv(backend_auth.TOKEN_ENV, "short")
    with pytest.raises(backend_auth.TokenError):
        _app([])
    assert len(backend_auth.new_token()) >= backend_auth.MIN_LENGTH
