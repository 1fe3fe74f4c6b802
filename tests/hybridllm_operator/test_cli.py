"""`hybridllm operator run`: the documented settings are read."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from hybridllm_common import cli as common_cli
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


HEAVY = ("torch", "transformers", "pandas", "sklearn", "onnxruntime", "llama_cpp")
# what a user types to find their way and to look at a running service: each loads its
# own command's module and none of the libraries above
LIGHT = [
    ["--help"],
    *([command, "--help"] for command in common_cli.COMMANDS),
    ["status"],
    ["logs"],
    ["down"],
    ["rollout", "status", "svc", "--local"],
]
LOADED = (
    "import sys\n"
    "from hybridllm_common import cli\n"
    "try:\n"
    "    cli.main(sys.argv[1:])\n"
    "except SystemExit:\n"
    "    pass\n"
    f"mods = [m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r} or m.startswith('hybridllm_')]\n"
    "print('LOADED', ' '.join(sorted(mods)))\n"
)


def test_the_command_list_and_the_looking_commands_load_no_heavy_library(
    tmp_path: Path,
) -> None:
    """`hybridllm --help` lists every installed command from `COMMANDS` without importing
    any; `hybridllm COMMAND --help`, `status`, `logs`, `down` and `rollout status` import
    their own command and none of torch, transformers, pandas, scikit-learn, onnxruntime or
    llama.cpp (each in a fresh interpreter, all at once)."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}  # no local service here
    procs = [
        (argv, subprocess.Popen([sys.executable, "-c", LOADED, *argv], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for argv in LIGHT
    ]  # fmt: skip
    for argv, proc in procs:
        out, err = proc.communicate(timeout=120)
        loaded = out.rsplit("LOADED", 1)[1].split()
        heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
        assert heavy == [], (argv, heavy)
        if argv == ["--help"]:
            assert {m.split(".")[0] for m in loaded} == {"hybridllm_common"}, loaded
            listed = out.split("options:")[0]
            for entry_point in metadata.entry_points(group=common_cli.ENTRY_POINT_GROUP):
                assert f"    {entry_point.name}" in listed, (entry_point.name, out)
                assert common_cli.summary(entry_point.name).split()[0] in listed
        elif argv[1:] == ["--help"]:
            assert f"usage: hybridllm {argv[0]}" in out, (argv, out, err)
        else:  # the command ran and said what it found: no local service
            assert "no local service" in err or "svc is not running" in err, (argv, err)


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
