"""Progress reporting without a UI dependency in the store.

The store and the conversions report through a ``Progress``: ``task(description, total)``
returns a callable that advances the task by a number of units (bytes, tensors). The CLI
passes a rich-backed one; library callers get ``NULL`` which does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Advance = Callable[[int], None]


class Progress(Protocol):
    def task(self, description: str, total: int | None) -> Advance: ...


class _NullProgress:
    def task(self, description: str, total: int | None) -> Advance:
        return _ignore


def _ignore(_: int) -> None:
    return None


NULL: Progress = _NullProgress()
