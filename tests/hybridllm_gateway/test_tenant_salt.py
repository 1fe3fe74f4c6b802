"""The gateway gives each tenant its own prefix-cache partition (``cache_salt``).

A real gateway process in front of a small recording upstream (an HTTP server in this
test that answers a fixed completion and keeps every body it received).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import openai
import pytest

from hybridllm_gateway import safety

MODEL = "smollm2"


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[dict[str, Any]] = []

    def do_GET(self) -> None:
        self._json({"status": "ok"} if self.path == "/health" else {"object": "list", "data": []})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
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


@pytest.fixture
def upstream() -> Iterator[str]:
    _Recorder.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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
