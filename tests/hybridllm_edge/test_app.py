"""The app before its model is loaded: /health and the API answer 503 model_not_ready."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hybridllm_edge import config
from hybridllm_edge.server import app as app_mod


def test_not_ready_until_the_lifespan_has_loaded_the_model() -> None:
    app = app_mod.create_app(config.EdgeSettings(model="/nonexistent.gguf"))
    client = TestClient(app)  # not entered: the lifespan (model load) does not run
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["code"] == "model_not_ready"
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.status_code == 503
    assert chat.json()["error"]["code"] == "model_not_ready"
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] is None
