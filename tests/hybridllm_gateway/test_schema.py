"""schemathesis against the gateway's OpenAPI document: no input makes it answer 5xx.

The gateway in front of a token server; each answer must be a success or a 4xx. Meanwhile
a client streams the same completion through the gateway again and again: every one of
those streams must complete with the text it gives when run alone, whatever the fuzzer
sends beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis

from hybridllm_gateway import openapi

from ..conftest import streams_beside
from .conftest import TOKENSERVER

SPEC = openapi.spec()
schema = (
    schemathesis.openapi.from_dict(SPEC)
    if hasattr(schemathesis, "openapi") and hasattr(schemathesis.openapi, "from_dict")
    else schemathesis.from_dict(SPEC)
)


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import socket
    import time

    import httpx

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    tmp: Path = tmp_path_factory.mktemp("schema")
    bport, gport = port(), port()
    backend = subprocess.Popen([sys.executable, str(TOKENSERVER), "--port", str(bport), "--rate", "10000", "--max-tokens", "8"])  # fmt: skip
    table = {
        "model": "smollm2",
        "tiers": {"edge": {"backends": [{"url": f"http://127.0.0.1:{bport}"}]}},
        # The fuzzer and the steady streams share one client address: a limit high enough
        # that neither is refused for the other's traffic.
        "rateLimits": {"requestsPerMinute": 1_000_000, "tokensPerMinute": 100_000_000},
    }
    (tmp / "routing.json").write_text(json.dumps(table))
    gw = subprocess.Popen([sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config", str(tmp / "routing.json"), "--port", str(gport), "--host", "127.0.0.1"])  # fmt: skip
    url = f"http://127.0.0.1:{gport}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield url
    for p in (gw, backend):
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def steady_streams(gateway_url: str) -> Iterator[list[str]]:
    """Well-formed streams beside the fuzzer; checked against the answer alone at the end."""
    request = {"model": "smollm2", "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    with streams_beside(gateway_url, request) as texts:
        yield texts


@pytest.mark.usefixtures("steady_streams")
@schema.parametrize()
def test_no_server_errors(case, gateway_url: str) -> None:  # type: ignore[no-untyped-def]
    response = case.call(base_url=gateway_url, timeout=30)
    assert response.status_code < 500, (case, response.status_code, response.text[:300])
