"""The edge distribution must install and import without torch (edge devices cannot carry it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "triton", "transformers")


def _export(package: str) -> list[str]:
    uv = shutil.which("uv")
    assert uv, "uv is required (hack/setup.sh installs it)"
    out = subprocess.run(
        [
            uv,
            "export",
            "--package",
            package,
            "--frozen",
            "--no-dev",
            "--no-hashes",
            "--no-emit-workspace",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [
        line.split("==")[0].strip()
        for line in out.splitlines()
        if line and not line.lstrip().startswith("#")
    ]


def test_edge_dependency_set_has_no_torch() -> None:
    names = _export("hybridllm-runtime-edge")
    assert "llama-cpp-python" in names
    assert "onnxruntime" in names
    assert not [n for n in names if n in FORBIDDEN or n.startswith("nvidia-")]


def test_cloud_dependency_set_does_have_torch() -> None:
    # the same check on a distribution that needs torch, so the test above can fail
    assert "torch" in _export("hybridllm-runtime-cloud")


@pytest.mark.slow
def test_edge_installs_and_imports_in_a_clean_environment(tmp_path: Path) -> None:
    """A fresh venv with only the edge distribution's locked dependencies imports without torch."""
    uv = shutil.which("uv")
    assert uv
    venv = tmp_path / "venv"
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv), "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    sync = [uv, "sync", "--frozen", "--no-dev", "--package", "hybridllm-runtime-edge",
            "--python", sys.executable]  # fmt: skip
    # Offline first, as hack/setup.sh does: uv then takes its cached package index as it is
    # and installs the llama.cpp wheel it built before. Online, an index answer with no
    # cache lifetime is fetched again, counts as a new revision of the sdist, and llama.cpp
    # is compiled again (7 min on two cores). Online only when the cache lacks something
    # (a new pin in uv.lock).
    offline = subprocess.run([*sync, "--offline"], cwd=ROOT, env=env, check=False,
                             capture_output=True, text=True)  # fmt: skip
    if offline.returncode != 0:
        subprocess.run(sync, cwd=ROOT, env=env, check=True, capture_output=True)
    probe = (
        "import importlib.util, sys; import hybridllm_edge, hybridllm_models, hybridllm_common, llama_cpp, onnxruntime; "
        "print([m for m in ('torch', 'triton', 'transformers') if importlib.util.find_spec(m) or m in sys.modules])"
    )
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
