"""`hybridllm operator run`: the documented settings are read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridllm_operator import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hybrid-cpu.yaml"


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


def test_the_operator_process_loads_no_data_science_libraries() -> None:
    """The operator's handlers (what `operator run` serves) need numpy for the forecasts,
    not pandas (the trace loaders' library, about 45 MB of memory), scikit-learn, scipy,
    torch or matplotlib."""
    code = (
        "import sys; import hybridllm_operator.handlers; "
        "heavy = ('pandas', 'sklearn', 'scipy', 'torch', 'matplotlib'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("address", ["8081", "0.0.0.0:http", "0.0.0.0:70000"])
def test_a_bad_metrics_address_is_refused_by_name(address: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "operator", "run", "--metrics", address],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"cannot serve metrics on {address}" in out.stderr
    assert "HOST:PORT" in out.stderr


def test_the_metrics_address_comes_from_the_environment_and_a_taken_port_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        out = subprocess.run(
            [sys.executable, "-m", "hybridllm_common.cli", "operator", "run"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "HYBRIDLLM_OPERATOR_METRICS_ADDRESS": address},
        )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"cannot serve metrics on {address}" in out.stderr
    assert "in use" in out.stderr


def test_hybridllm_up_refuses_a_bad_metrics_address_before_starting_anything(
    tmp_path: Path,
) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    out = subprocess.run(
        [sys.executable, "-m", "hybridllm_common.cli", "up", "-f", str(EXAMPLE), "--port", port,
         "--state-root", str(tmp_path), "--metrics", "localhost"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--metrics localhost" in out.stderr
    assert "HOST:PORT" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
