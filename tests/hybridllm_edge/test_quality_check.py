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
