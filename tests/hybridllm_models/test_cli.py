"""``hybridllm model ...`` through the real dispatcher: summary lines, exit codes, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridllm_common import cli


def test_pull_list_verify(
    store_root: Path, tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["model", "pull", f"file://{tiny_gguf}"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("tiny/local-")
    assert "gguf F32" in line

    assert cli.main(["model", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == [line]

    assert cli.main(["model", "verify"]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")

    stored = next(store_root.glob("tiny/*/source/tiny.gguf"))
    data = bytearray(stored.read_bytes())
    data[-1] ^= 1
    stored.write_bytes(bytes(data))
    assert cli.main(["model", "verify", "tiny"]) == 1
    captured = capsys.readouterr()
    assert "FAILED: " in captured.out
    assert "sha256" in captured.out
    assert "--force" in captured.err


def test_errors_are_one_line(store_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "pull", "ftp://example.org/model.gguf"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown source scheme 'ftp'")
    assert "Traceback" not in err
