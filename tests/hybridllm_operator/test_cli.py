"""`hybridllm operator run`: the documented settings are read."""

from __future__ import annotations

import subprocess
import sys

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


def test_a_subcommand_loads_only_its_own_distribution() -> None:
    """`hybridllm up` (and `operator run`) must not pay for torch and scikit-learn, which
    only `cloud` and `forecast` need: each entry point is named after its subcommand."""
    code = (
        "import sys; from hybridllm_common import cli; "
        "p = cli.build_parser(only=sys.argv[1]); "
        "print(sorted(m for m in ('torch', 'sklearn') if m in sys.modules))"
    )
    for command in ("up", "operator", "status"):
        out = subprocess.run(
            [sys.executable, "-c", code, command], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "[]", (command, out.stdout)
