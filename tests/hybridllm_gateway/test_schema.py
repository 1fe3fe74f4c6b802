"""schemathesis against the gateway's OpenAPI document: no input makes it answer 5xx.

schemathesis is not in the workspace lock (it is a test-only tool the lead may add to the
root dev group); run this with ``uv run --with schemathesis pytest tests/hybridllm_gateway/test_schema.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hybridllm_gateway import openapi  # noqa: E402

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
    backend = subprocess.Popen([sys.executable, "-m", "hybridllm_gateway.tokenserver", "--port", str(bport), "--rate", "10000", "--max-tokens", "8"])  # fmt: skip
    table = {
        "model": "smollm2",
        "tiers": {"edge": {"backends": [{"url": f"http://127.0.0.1:{bport}"}]}},
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


@schema.parametrize()
def test_no_server_errors(case, gateway_url: str) -> None:  # type: ignore[no-untyped-def]
    response = case.call(base_url=gateway_url, timeout=30)
    assert response.status_code < 500, (case, response.status_code, response.text[:300])
