"""The gateway gives each tenant its own prefix-cache partition (``cache_salt``), and shows
the backend token to the service's runtimes, never to an enrolled device.

A real gateway process in front of small recording upstreams (HTTP servers in this test
that answer a fixed completion and keep every body and Authorization header received).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from hybridllm_common import backend_auth
from hybridllm_gateway import safety

MODEL = "smollm2"


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []
    authorization: list[tuple[int, str | None]] = []  # (the upstream's port, the header)

    def do_GET(self) -> None:
        self._json({"status": "ok"} if self.path == "/health" else {"object": "list", "data": []})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        port = self.server.server_address[1]
        type(self).authorization.append((port, self.headers.get("authorization")))
        self._json(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    def _json(self, data: object) -> None:
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _recording() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def upstream() -> Iterator[str]:
    _Recorder.bodies, _Recorder.authorization = [], []
    with _recording() as url:
        yield url


def test_the_backend_token_goes_to_the_runtimes_and_never_to_a_device(procs, table, upstream):
    token = "t" * 40
    with _recording() as device:
        routing = table(cloud=[upstream], edge=[device])
        routing["tiers"]["edge"]["backends"][0]["device"] = True  # as the operator marks them
        gw = procs.gateway(routing, env={backend_auth.TOKEN_ENV: token})
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        for tier in ("cloud", "edge", "cloud"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_headers={"x-hybridllm-tier": tier},
            )  # fmt: skip
        port = {url: int(url.rsplit(":", 1)[1]) for url in (upstream, device)}
        assert _Recorder.authorization == [
            (port[upstream], f"Bearer {token}"), (port[device], None),
            (port[upstream], f"Bearer {token}"),
        ]  # fmt: skip
    # a token too short to be one is a gateway that does not start, not one that is open
    bad = procs.tmp / "short.log"
    with bad.open("wb") as out:
        refused = subprocess.run(
            [sys.executable, "-m", "hybridllm_gateway.cli", "serve", "--config",
             str(procs.tmp / "routing.json"), "--port", "0"],
            env={**os.environ, backend_auth.TOKEN_ENV: "short"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=60,
        )  # fmt: skip
    assert refused.returncode != 0
    assert "at least 32 printable characters" in bad.read_text()


def test_each_tenant_gets_its_own_salt_and_cannot_choose_another(procs, table, upstream) -> None:
    keys = procs.tmp / "keys"
    keys.write_text(f"tenant-a:{safety.hash_key('key-a')}\ntenant-b:{safety.hash_key('key-b')}\n")
    gw = procs.gateway(table(cloud=[upstream]), "--api-keys-file", str(keys))
    for key, salt in (("key-a", None), ("key-b", "tenant-a"), ("key-a", "forged")):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        extra = {} if salt is None else {"cache_salt": salt}
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body=extra,
            extra_headers={"x-hybridllm-tier": "cloud"},
        )
    assert [b["cache_salt"] for b in _Recorder.bodies] == ["tenant-a", "tenant-b", "tenant-a"]


def test_without_keys_the_clients_salt_passes_through(procs, table, upstream) -> None:
    gw = procs.gateway(table(cloud=[upstream]))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"cache_salt": "mine"},
        extra_headers={"x-hybridllm-tier": "cloud"},
    )
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"x-hybridllm-tier": "cloud"},
    )
    assert [b.get("cache_salt") for b in _Recorder.bodies] == ["mine", None]
