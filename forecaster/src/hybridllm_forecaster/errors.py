"""Errors a user can act on: every trace problem names the file and, when known, the line."""

from __future__ import annotations

from pathlib import Path


class TraceFormatError(ValueError):
    """A trace file that cannot be read as its format; the message starts with path:line."""

    def __init__(self, path: Path | str, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")
