"""The cloud runtime re-hashes its model store artifact before loading it."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.server import app as app_mod
from hybridllm_models import uri


def test_a_corrupt_artifact_is_refused_and_the_server_says_why(
    corrupt_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDLLM_MODEL_CACHE", str(corrupt_store))
    settings = config_mod.ServeSettings(model=uri.DEFAULT_URI, device="cpu", dtype="float32")
    with TestClient(app_mod.create_app(settings)) as client:
        health = client.get("/health")
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}]},
        )
        completion = client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
    assert health.status_code == 503
    message = health.json()["error"]["message"]
    assert "is corrupt and was not loaded" in message
    assert "model.safetensors: sha256" in message
    assert f"hybridllm model convert {uri.DEFAULT_URI} --to hf --force" in message
    for response in (chat, completion):
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_not_ready"
