"""Synthetic traces with known shape, written in each supported format."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from hybridllm_forecaster import cli
from hybridllm_forecaster.stream import RequestStream


def run_cli(argv: list[str]) -> int:
    """`hybridllm ARGV` of the forecaster's commands, in this process: the exit status."""
    parser = argparse.ArgumentParser(prog="hybridllm")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def ramp_stream(
    duration_s: float = 3600.0, low: float = 2.0, high: float = 12.0, seed: int = 0
) -> RequestStream:
    """Poisson arrivals whose rate rises from `low` to `high` req/s and back (one hump)."""
    rng = np.random.default_rng(seed)
    peak = high
    t = np.cumsum(rng.exponential(1.0 / peak, size=int(peak * duration_s * 1.2)))
    t = t[t < duration_s]
    rate = low + (high - low) * np.sin(np.pi * t / duration_s) ** 2
    keep = rng.random(len(t)) < rate / peak
    t = t[keep]
    n = len(t)
    return RequestStream(
        arrival_s=t,
        input_tokens=rng.integers(200, 3000, size=n),
        output_tokens=rng.integers(20, 400, size=n),
        source="synthetic-ramp",
    )


def write_azure_csv(path: Path, stream: RequestStream) -> Path:
    base = np.datetime64("2024-05-10T00:00:00", "us")
    stamps = np.datetime_as_string(base + (stream.arrival_s * 1e6).astype("timedelta64[us]"))
    rows = np.char.add(np.char.replace(stamps, "T", " "), ",")
    rows = np.char.add(rows, np.char.add(stream.input_tokens.astype(str), ","))
    rows = np.char.add(rows, stream.output_tokens.astype(str))
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows.tolist()) + "\n")
    return path


def write_mooncake(path: Path, stream: RequestStream) -> Path:
    with path.open("w") as f:
        for k, (t, i, o) in enumerate(
            zip(stream.arrival_s, stream.input_tokens, stream.output_tokens, strict=True)
        ):
            rec = {"timestamp": int(t * 1000), "input_length": int(i), "output_length": int(o),
                   "hash_ids": [0, k + 1]}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    return path


def write_servegen_client(path: Path, rates: np.ndarray, cv: float = 1.0) -> Path:
    lines = []
    for k, r in enumerate(rates):
        if r > 0:
            shape = 1 / cv**2
            lines.append(f"{k * 600},{r},{cv},Gamma,{shape},{1 / (r * shape)}")
        else:
            lines.append(f"{k * 600},0.0,,,,")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_trajectory(path: Path, num_calls: int = 3) -> Path:
    history = [{"role": "system", "content": "s" * 400}, {"role": "user", "content": "u" * 800}]
    for k in range(num_calls):
        history.append({"role": "assistant", "content": "a" * (40 * (k + 1))})
        history.append({"role": "user", "content": "o" * 200})
    path.write_text(json.dumps({"history": history, "trajectory": [], "info": {}}))
    return path


@pytest.fixture
def small_stream() -> RequestStream:
    return ramp_stream(duration_s=1800.0, low=1.0, high=6.0)


class Writers:
    """The helpers above, handed to tests as a fixture (test files do not import conftest)."""

    ramp_stream = staticmethod(ramp_stream)
    azure_csv = staticmethod(write_azure_csv)
    mooncake = staticmethod(write_mooncake)
    servegen_client = staticmethod(write_servegen_client)
    trajectory = staticmethod(write_trajectory)


@pytest.fixture
def traces() -> type[Writers]:
    return Writers
