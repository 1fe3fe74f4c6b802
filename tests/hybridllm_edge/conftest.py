"""Shared fixtures: one real edge server per backend per session (SmolLM2-135M from the store).

The server runs in-process (uvicorn in a thread, on a free loopback port), so the tests speak
HTTP through the real ``openai`` client and can still look at the engine and backend state
(``app.state.engine``) to check what a request left behind.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import uvicorn
from fastapi import FastAPI

from hybridllm_edge import config
from hybridllm_edge.server import app as app_mod


@dataclass
class Running:
    app: FastAPI
    base_url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)


def serve(settings: config.EdgeSettings) -> Iterator[Running]:
    app = app_mod.create_app(settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    ready = threading.Event()
    startup = server.startup

    async def signalled_startup(sockets: list[socket.socket] | None = None) -> None:
        await startup(sockets=sockets)
        ready.set()

    server.startup = signalled_startup  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert ready.wait(timeout=300), "edge server did not start"
    try:
        yield Running(app, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="session")
def llamacpp_server() -> Iterator[Running]:
    settings = config.EdgeSettings(
        backend="llamacpp", parallel=4, max_model_len=512, threads=1, cache_max_entries=64
    )
    yield from serve(settings)


@pytest.fixture(scope="session")
def onnx_server() -> Iterator[Running]:
    settings = config.EdgeSettings(backend="onnx", parallel=4, max_model_len=256, threads=1)
    yield from serve(settings)


@pytest.fixture
def broken_onnx_server(broken_int8_dir: Path) -> Iterator[Running]:
    """An edge server given an int8 export with wrong scales (see tests/conftest.py)."""
    settings = config.EdgeSettings(
        model=str(broken_int8_dir), backend="onnx", quantization="int8", threads=1, parallel=1
    )
    yield from serve(settings)
