"""Cache-hit latency end to end, and how much of it is the client's own work.

The same cached greedy question is timed four ways over keep-alive loopback connections:

- the ``openai`` client's ``chat.completions.create`` (how an application calls us),
  and its ``with_raw_response`` variant (which also exposes the headers);
- a plain ``httpx.Client`` post with ``.json()``;
- both clients again against ``bench/edge/replay.py``, a trivial server that answers every
  request with the bytes our server sent for that hit.

Against the replay server the server does nothing, so ``openai(replay) - httpx(replay)``
is the openai client's own cost per call and ``httpx(ours) - httpx(replay)`` is our
server's share of a hit.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ASK = {"model": "", "messages": [{"role": "user", "content": "What is the capital of France?"}],
       "max_tokens": 16, "temperature": 0}  # fmt: skip


def _timed(call: Callable[[], Any], repeats: int) -> dict[str, float]:
    for _ in range(5):
        call()
    lat = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        lat.append(1000 * (time.perf_counter() - t0))
    lat.sort()
    return {"median_ms": statistics.median(lat), "p95_ms": lat[int(0.95 * (len(lat) - 1))]}


def _recorded_hit(port: int) -> bytes:
    """The raw HTTP response of one cache hit, read off a socket."""
    body = json.dumps(ASK).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, rest = data.split(b"\r\n\r\n", 1)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            rest += s.recv(65536)
    assert b"x-hybridllm-cache: hit" in head, head
    return head + b"\r\n\r\n" + rest


def measure(base: str, port: int, replay_port: int, repeats: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    t0 = time.perf_counter()
    client.chat.completions.create(**ASK)
    miss_s = time.perf_counter() - t0
    raw = client.chat.completions.with_raw_response.create(**ASK)
    assert raw.headers["x-hybridllm-cache"] == "hit"
    recorded = Path(tempfile.mkdtemp(prefix="edge-hit-")) / "response.bin"
    recorded.write_bytes(_recorded_hit(port))
    replay_cmd = [sys.executable, str(Path(__file__).with_name("replay.py")),
                  str(replay_port), str(recorded)]  # fmt: skip
    replay = subprocess.Popen(replay_cmd)
    replay_base = f"http://127.0.0.1:{replay_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", replay_port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        replay_client = openai.OpenAI(base_url=f"{replay_base}/v1", api_key="unused",
                                      max_retries=0)  # fmt: skip
        with httpx.Client(base_url=base) as http, httpx.Client(base_url=replay_base) as rhttp:
            out = {
                "openai_create": _timed(lambda: client.chat.completions.create(**ASK), repeats),
                "openai_raw_response": _timed(
                    lambda: client.chat.completions.with_raw_response.create(**ASK).parse(),
                    repeats,
                ),
                "httpx": _timed(
                    lambda: http.post("/v1/chat/completions", json=ASK).json(), repeats
                ),
                "openai_create_vs_replay": _timed(
                    lambda: replay_client.chat.completions.create(**ASK), repeats
                ),
                "httpx_vs_replay": _timed(
                    lambda: rhttp.post("/v1/chat/completions", json=ASK).json(), repeats
                ),
            }
    finally:
        replay.kill()
        replay.wait()
    med = {k: v["median_ms"] for k, v in out.items()}
    return {
        "miss_s": miss_s,
        "repeats": repeats,
        **out,
        "openai_client_overhead_ms": med["openai_create_vs_replay"] - med["httpx_vs_replay"],
        "server_share_ms": med["httpx"] - med["httpx_vs_replay"],
    }
