"""`hybridllm operator run`: the documented settings are read."""

from __future__ import annotations

import pytest

from hybridllm_operator import cli


def test_the_namespace_comes_from_the_flag_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HYBRIDLLM_OPERATOR_NAMESPACE", raising=False)
    assert cli.watched_namespaces(None) == []
    assert cli.watched_namespaces("team-a") == ["team-a"]
    monkeypatch.setenv("HYBRIDLLM_OPERATOR_NAMESPACE", "team-b")
    assert cli.watched_namespaces(None) == ["team-b"]
    assert cli.watched_namespaces("team-a") == ["team-a"]
