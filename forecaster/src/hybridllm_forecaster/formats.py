"""The trace formats the loaders read, by name: what `hybridllm forecast --format` accepts
(this module imports nothing heavy, so the command's help needs no pandas)."""

from __future__ import annotations

FORMATS = ("requests-csv", "mooncake", "servegen", "swe-agent")
FORMAT_ALIASES = {"azure": "requests-csv", "csv": "requests-csv", "swe": "swe-agent"}


def normalise_format(fmt: str | None) -> str | None:
    if fmt is None:
        return None
    fmt = FORMAT_ALIASES.get(fmt.lower(), fmt.lower())
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return fmt
