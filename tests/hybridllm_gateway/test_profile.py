"""`hybridllm profile` against a replica of known speed (a token server whose first token
waits for the prompt at 2,000 tokens/s and whose tokens come 10 ms apart plus 2 ms for
every other answer in flight): the capacity block it prints is that replica's."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridllm_operator import profile

from .conftest import MODEL


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridllm")
    profile.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_profile_measures_a_replicas_prefill_rate_and_decode_step(procs, capsys) -> None:
    replica = procs.tokenserver("known", "--rate", "100", "--ttft-s", "0.01",
                                "--prefill-rate", "2000", "--slowdown-s", "0.002")  # fmt: skip
    argv = ["profile", "--url", replica.url, "--model", MODEL, "--slots", "4",
            "--requests", "3", "--max-tokens", "16", "--prompt-repeats", "4,16,48"]  # fmt: skip
    assert run([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["levels"] == [1, 2, 4]
    assert got["answers"] == 3 * 3 + 3 * (1 + 2 + 4)  # prefill: 3 of each size; the sweep
    assert got["prefillTokensPerSecond"] == pytest.approx(2000, rel=0.15)
    # a decode step of 8 ms + 2 ms a sequence, 4 slots within the TBT objective: 4 / 0.016 s
    assert got["decodeTokensPerSecond"] == pytest.approx(4 / 0.016, rel=0.15)
    assert got["tpotSeconds"]["1"] == pytest.approx(0.01, rel=0.15)
    # as a person reads it: the block for the manifest, with where it goes
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "spec.edge.pool.capacity (measured" in out
    assert "  capacity:\n    prefillTokensPerSecond: " in out
    # a replica that sends no usage cannot be profiled: said, not guessed
    assert run(["profile", "--url", replica.url + "/nowhere", "--model", MODEL, "--slots",
                "1", "--requests", "1"]) == 1  # fmt: skip
    assert "answered 404" in capsys.readouterr().err
