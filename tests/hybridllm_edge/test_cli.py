"""The operator's command line parses into EdgeSettings; bad combinations are refused."""

from __future__ import annotations

import argparse

import pytest

from hybridllm_edge import cli, config


def _parse(argv: list[str]) -> config.EdgeSettings:
    parser = argparse.ArgumentParser()
    cli._add_serve(parser.add_subparsers(dest="command"))
    return cli.settings_from_args(parser.parse_args(["serve", *argv]))


def test_operator_flags() -> None:
    s = _parse(
        [
            "--model",
            "file:///m/x.gguf",
            "--served-model-name",
            "smol",
            "--max-model-len",
            "1024",
            "--backend",
            "llamacpp",
            "--quantization",
            "q8_0",
            "--parallel",
            "8",
            "--port",
            "8001",
            "--cache-ttl-seconds",
            "60",
            "--cache-max-entries",
            "10",
        ]
    )
    assert (s.model, s.served_model_name, s.max_model_len, s.parallel, s.port) == (
        "file:///m/x.gguf", "smol", 1024, 8, 8001,
    )  # fmt: skip
    assert (s.cache, s.cache_ttl_seconds, s.cache_max_entries) == (True, 60.0, 10)
    assert s.store_target() == "gguf-q8_0"
    assert _parse(["--no-cache"]).cache is False
    assert _parse(["--backend", "onnx", "--quantization", "int8"]).store_target() == "onnx-int8"
    assert _parse([]).store_target() == "gguf"  # the shipped Q4_1


def test_environment_fills_what_flags_leave_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDLLM_EDGE_PARALLEL", "3")
    assert _parse([]).parallel == 3
    assert _parse(["--parallel", "5"]).parallel == 5


def test_quantization_of_the_other_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="does not apply to the onnx backend"):
        _parse(["--backend", "onnx", "--quantization", "q4_1"]).store_target()
    assert cli.main(["serve", "--backend", "llamacpp", "--quantization", "int8"]) == 2
