"""The gateway gives each tenant its own prefix-cache partition (``cache_salt``), shows
the backend token to the service's runtimes, never to an enrolled device, and speaks TLS to
a device, verifying that its certificate names the device meant (``device_tls``).

A real gateway process in front of small recording upstreams (HTTP servers in this test
that answer a fixed completion and keep every body and Authorization header received).
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from hybridllm_common import backend_auth, device_tls, signing
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
def _recording(tls: ssl.SSLContext | None = None) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def upstream() -> Iterator[str]:
    _Recorder.bodies, _Recorder.authorization = [], []
    with _recording() as url:
        yield url


def _device_tls(tmp: Path, device: str) -> tuple[ssl.SSLContext, str]:
    """A device's server context with the certificate its fleet issues it, and that CA."""
    fleet_key, device_key = signing.generate_key(), signing.generate_key()
    cert, key = tmp / f"{device}.crt", tmp / f"{device}.key"
    cert.write_text(device_tls.issue(fleet_key, "shops", "stores", device,
                                     device_key.public_key(), time.time()))  # fmt: skip
    key.write_text(device_tls.private_key_pem(device_key))
    ca = device_tls.ca_certificate(fleet_key, "shops", "stores")
    return device_tls.server_context(str(cert), str(key)), ca


def test_the_backend_token_goes_to_the_runtimes_and_never_to_a_device(procs, table, upstream):
    """...and the device is reached over TLS, its certificate checked for its name: at
    the same address, a device with another name's certificate is refused (502, naming
    the check, not the address)."""
    token = "t" * 40
    context, ca = _device_tls(procs.tmp, "dev-a")
    with _recording(context) as device:
        routing = table(cloud=[upstream], edge=[device])
        routing["deviceCA"] = ca
        backend = routing["tiers"]["edge"]["backends"][0]
        backend["device"] = True  # as the operator marks them
        backend["serverName"] = device_tls.server_name("dev-a", "shops", "stores")
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
        backend["serverName"] = device_tls.server_name("dev-b", "shops", "stores")
        other = procs.gateway(routing)  # sent to dev-b, and dev-a's certificate answers
        impostor = httpx.post(other.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        }, headers={"x-hybridllm-tier": "edge"}, timeout=30)  # fmt: skip
        assert impostor.status_code == 502, impostor.text
        message = impostor.json()["error"]["message"]
        assert "failed its TLS certificate check" in message
        assert "127.0.0.1" not in message
        assert len(_Recorder.authorization) == 3  # nothing reached it
        metrics = httpx.get(other.url + "/metrics").text
        assert 'hybridllm_gateway_upstream_errors_total{kind="tls",tier="edge"}' in metrics
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
