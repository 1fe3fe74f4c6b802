"""Paths as results files record them: relative to the repository, the home folder as ``~``.

A results file is read on other machines; this machine's checkout and home directory mean
nothing there (``/home/x/hybridllm/.venv/bin/python`` becomes ``.venv/bin/python``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def portable(text: str) -> str:
    return text.replace(f"{ROOT}/", "").replace(str(ROOT), ".").replace(str(Path.home()), "~")
