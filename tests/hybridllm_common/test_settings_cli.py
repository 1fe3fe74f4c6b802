"""Flags generated from a settings model, shared by the runtimes' `serve` commands."""

from __future__ import annotations

import argparse
from typing import Literal

import pydantic
import pytest
from pydantic_settings import BaseSettings, SettingsConfigDict

from hybridllm_common import cli


class Demo(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEMO_", extra="ignore")
    max_num_seqs: int = pydantic.Field(default=8, ge=1, description="running requests")
    role: Literal["a", "b"] = pydantic.Field(default="a", description="role")
    cache: bool = pydantic.Field(default=True, description="cache answers")
    url: str | None = pydantic.Field(default=None, description="upstream")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.add_settings_flags(parser, Demo, "DEMO_")
    return parser.parse_args(argv)


def test_flags_types_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEMO_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("DEMO_URL", "http://env")
    got = cli.settings_from_args(parse(["--role", "b", "--no-cache", "--url", "http://flag"]), Demo)
    assert (got.role, got.cache, got.url, got.max_num_seqs) == ("b", False, "http://flag", 5)
    with pytest.raises(argparse.ArgumentError):
        parse(["--role", "c"])


def test_invalid_values_are_reported_with_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        cli.settings_from_args(parse(["--max-num-seqs", "0"]), Demo)
    assert cli.report_invalid("demo serve", info.value) == 2
    assert capsys.readouterr().err.startswith("demo serve: max_num_seqs: Input should be greater")
