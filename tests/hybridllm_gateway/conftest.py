"""Real processes: fixed-rate token servers as backends and the gateway in front of them.

Every server is a subprocess on a free loopback port, started the way an operator or a
developer starts it (``python -m ...``); readiness is awaited by polling ``/health`` with
a deadline, never by sleeping a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

TOKENSERVER = Path(__file__).resolve().parents[2] / "bench" / "tokenserver.py"  # a test double

MODEL = "smollm2"
CLIENT = httpx.Client(timeout=30.0)  # one pool for the whole session: cheap requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    name: str = ""

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/stats", timeout=5.0).json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


@dataclass
class Procs:
    tmp: Path
    started: list[Server] = field(default_factory=list)

    def tokenserver(self, name: str, *args: str) -> Server:
        return self.tokenservers([name], *args)[0]

    def tokenservers(self, names: list[str], *args: str) -> list[Server]:
        """Starts them all, then waits for each: the imports overlap."""
        servers = [self._start_tokenserver(n, *args) for n in names]
        for s in servers:
            wait_healthy(s.url, s.proc)
        return servers

    def tokenserver_on(self, port: int, name: str, *args: str) -> Server:
        """A token server on a chosen port (a replica coming up where one was expected)."""
        server = self._start_tokenserver(name, *args, port=port)
        wait_healthy(server.url, server.proc)
        return server

    def _start_tokenserver(self, name: str, *args: str, port: int | None = None) -> Server:
        port = port or free_port()
        cmd = [sys.executable, str(TOKENSERVER), "--port", str(port),
               "--id", name, "--model", MODEL, *args]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = Server(f"http://127.0.0.1:{port}", proc, name)
        self.started.append(server)
        return server

    def gateway(
        self,
        routing: dict[str, Any],
        *args: str,
        name: str = "routing.json",
        env: dict[str, str] | None = None,
    ) -> Server:
        path = self.tmp / name
        path.write_text(json.dumps(routing))
        port = free_port()
        cmd = [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config", str(path),
               "--port", str(port), "--host", "127.0.0.1", "--reload-interval-s", "0.1",
               "--eject-base-s", "30", *args]  # fmt: skip
        log = (self.tmp / f"gateway-{port}.log").open("wb")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        server = Server(f"http://127.0.0.1:{port}", proc, "gateway")
        self.started.append(server)
        wait_healthy(server.url, proc)
        return server


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    for server in p.started:
        if server.proc.poll() is None:
            server.proc.terminate()
    for server in p.started:
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def routing(
    edge: list[str] | None = None, cloud: list[str] | None = None, **overrides: Any
) -> dict[str, Any]:
    """A routing table in the operator's wire format (see builders.build_routing_config)."""
    tiers: dict[str, Any] = {}
    if edge:
        tiers["edge"] = {"backends": [{"url": u, "revision": "v1", "weight": 100} for u in edge]}
    if cloud:
        tiers["cloud"] = {"backends": [{"url": u, "revision": "v1", "weight": 100} for u in cloud]}
    table: dict[str, Any] = {
        "service": "demo",
        "namespace": "test",
        "model": MODEL,
        "revision": "v1",
        "policy": "auto",
        "edgeLimits": {"maxPromptTokens": 2048, "maxOutputTokens": 512, "maxQueueDepth": 8},
        "sessionAffinity": {"enabled": True, "header": "x-session-id"},
        "cascade": {"enabled": False, "minMeanLogprob": -1.5},
        "rateLimits": {"requestsPerMinute": 100_000, "tokensPerMinute": 100_000_000},
        "tiers": tiers,
    }
    table.update(overrides)
    return table


def chat(
    url: str, content: str = "hi", headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    payload.update(body)
    return CLIENT.post(url + "/v1/chat/completions", json=payload, headers=headers)


@pytest.fixture
def ask() -> Callable[..., httpx.Response]:
    return chat


@pytest.fixture
def table() -> Callable[..., dict[str, Any]]:
    return routing
