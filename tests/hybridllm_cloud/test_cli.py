"""hybridllm-cloud serve: flags come from ServeSettings, the environment fills the rest."""

from __future__ import annotations

import argparse

import pytest

from hybridllm_cloud import cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    cli._add_serve(sub)
    return parser.parse_args(["serve", *argv])


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDLLM_CLOUD_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("HYBRIDLLM_CLOUD_PORT", "9001")
    args = parse(
        ["--model", "/m", "--port", "8123", "--no-enable-prefix-caching", "--dtype", "bfloat16"]
    )
    settings = cli.settings_from_args(args)
    assert settings.model == "/m"
    assert settings.port == 8123
    assert settings.max_num_seqs == 7
    assert settings.enable_prefix_caching is False
    assert settings.dtype == "bfloat16"
    assert settings.role == "monolithic"
    engine_config = settings.engine_config()
    assert engine_config.max_num_seqs == 7
    assert engine_config.enable_prefix_caching is False


def test_invalid_choice_is_rejected() -> None:
    with pytest.raises(SystemExit):
        parse(["--role", "router"])


def test_decode_role_needs_prefill_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--role", "decode"]) == 2
    assert "--prefill-url" in capsys.readouterr().err
    assert cli.main(["serve", "--role", "decode", "--prefill-url", "nohostport"]) == 2
    assert "prefill_url: 'nohostport'" in capsys.readouterr().err
