"""The llama.cpp backend checks a converted GGUF against its reference outputs before serving."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from hybridllm_edge import backends, config
from hybridllm_models import convert, quality, uri


def _settings(**fields: object) -> config.EdgeSettings:
    return config.EdgeSettings(
        backend="llamacpp", threads=1, parallel=1, max_model_len=256, **fields
    )


def test_a_converted_gguf_passes_its_check_through_the_decode_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="hybridllm_edge.backends"):
        backend = backends.load(_settings(quantization="q8_0"))
    backend.close()
    passed = [
        r.getMessage() for r in caplog.records if "passed its quality check" in r.getMessage()
    ]
    assert len(passed) == 1
    assert "(gguf Q8_0, llamacpp)" in passed[0]
    assert "over 100 positions" in passed[0]


def test_a_file_that_is_not_what_its_manifest_says_is_refused(tmp_path: Path) -> None:
    """A Q4_0 file under a Q8_0 manifest: hashes aside, its outputs give it away."""
    q8 = convert.ensure_artifact(uri.DEFAULT_URI, "gguf-q8_0")
    q4 = convert.ensure(uri.DEFAULT_URI, "gguf-q4_0")
    folder = tmp_path / "gguf-q8_0"
    folder.mkdir()
    shutil.copyfile(q8.path / "manifest.json", folder / "manifest.json")
    shutil.copyfile(q4, folder / q8.manifest.primary)
    with pytest.raises(quality.QualityError) as caught:
        backends.load(_settings(model=str(folder / q8.manifest.primary)))
    message = str(caught.value)
    assert "(gguf Q8_0, llamacpp) failed its quality check" in message
    assert "the limit of 0.03" in message
    assert "--force --to gguf-q8_0" in message


def test_a_corrupt_store_artifact_is_refused_before_loading(
    corrupt_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One flipped byte keeps the size the presence check looks at; the re-hash at load
    catches it, names the file and says how to rebuild it. The app stays up and says why."""
    from fastapi.testclient import TestClient

    import hybridllm_models
    from hybridllm_edge.server import app as app_mod

    monkeypatch.setenv("HYBRIDLLM_MODEL_CACHE", str(corrupt_store))
    with pytest.raises(hybridllm_models.IntegrityError) as caught:
        backends.load(_settings())
    message = str(caught.value)
    assert "is corrupt and was not loaded" in message
    assert "SmolLM2-135M-Instruct.Q4_1.gguf: sha256" in message
    assert f"hybridllm model pull --force {uri.DEFAULT_URI}" in message

    with TestClient(app_mod.create_app(_settings())) as client:
        health = client.get("/health")
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "x", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert health.status_code == 503
    assert "is corrupt" in health.json()["error"]["message"]
    assert chat.status_code == 503
    assert chat.json()["error"]["code"] == "model_not_ready"

    # --no-verify-model: the operator's choice for very large models; the file then loads
    backend = backends.load(_settings(verify_model=False))
    backend.close()
