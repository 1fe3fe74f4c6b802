"""Where KV bytes travel: endpoints and the transport seam.

The protocol (``protocol.Conn``) frames any connected stream socket, so a transport is
only "how to connect to an endpoint and how to accept connections":

- ``tcp://host:port`` (or plain ``host:port``): TCP, across hosts. A host name is resolved
  to all of its addresses, so a Kubernetes headless Service of the prefill pool yields one
  endpoint per pod; the decode side re-resolves periodically to follow scaling.
- ``unix:///path``: a Unix domain socket, for a prefill and a decode worker on one host
  (no TCP/IP stack; the kernel copies once per direction).

GPU transports (NCCL, NIXL/UCX) do not fit this seam as is: they move device memory
between registered buffers without a host copy. They would replace the KV frames'
payload path (``DecodeSide.write_blocks`` / ``PrefillSide`` copies) with a descriptor
exchange over this same control stream: the decode side sends the device addresses of its
destination blocks in ``PREFILL``, the prefill side issues the RDMA writes layer by layer and
sends ``DONE`` when they completed. See docs/cloud-runtime.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hybridllm_cloud.disagg import protocol

Handler = Callable[[protocol.Conn], Awaitable[None]]


@dataclass(frozen=True, order=True)
class Endpoint:
    scheme: str  # "tcp" | "unix"
    host: str  # or the socket path
    port: int = 0

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix://{self.host}"
        return f"tcp://{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``tcp://h:p``, ``h:p`` or ``unix:///path``; ValueError naming the problem."""
    raw = text.strip()
    if raw.startswith("unix://"):
        path = raw.removeprefix("unix://")
        if not path:
            raise ValueError(f"{text!r}: unix endpoint needs a socket path")
        return Endpoint("unix", path)
    for prefix in ("tcp://", "http://"):
        raw = raw.removeprefix(prefix)
    host, sep, port = raw.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: expected tcp://HOST:PORT, HOST:PORT or unix:///PATH")
    return Endpoint("tcp", host.strip("[]"), int(port))


def parse_endpoints(text: str) -> list[Endpoint]:
    return [parse_endpoint(part) for part in text.split(",") if part.strip()]


def resolve(endpoints: list[Endpoint]) -> list[Endpoint]:
    """Expands each TCP host name to all of its addresses (a headless Service: every pod)."""
    out: set[Endpoint] = set()
    for ep in endpoints:
        if ep.scheme != "tcp":
            out.add(ep)
            continue
        try:
            infos = socket.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM)
        except OSError:
            continue  # not resolvable now; the next resolution may find it
        for info in infos:
            out.add(Endpoint("tcp", str(info[4][0]), ep.port))
    return sorted(out)


async def connect(endpoint: Endpoint, timeout: float) -> protocol.Conn:
    """A framed connection to ``endpoint`` (TCP_NODELAY: headers must not wait for Nagle)."""
    loop = asyncio.get_running_loop()
    family = socket.AF_UNIX if endpoint.scheme == "unix" else _family(endpoint.host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        address: Any = (
            endpoint.host if endpoint.scheme == "unix" else (endpoint.host, endpoint.port)
        )
        await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
    except BaseException:
        sock.close()
        raise
    if endpoint.scheme == "tcp":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return protocol.Conn(sock)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class Server:
    """Accepts connections on a listening socket; runs ``handler(conn)`` for each."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        self.sock = sock
        self.handler = handler
        self._accepting: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> Any:
        return self.sock.getsockname()

    def start(self) -> None:
        self._accepting = asyncio.ensure_future(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            client, _ = await loop.sock_accept(self.sock)
            if client.family != socket.AF_UNIX:
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.ensure_future(self._run(protocol.Conn(client)))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _run(self, conn: protocol.Conn) -> None:
        try:
            await self.handler(conn)
        finally:
            conn.close()

    async def close(self) -> None:
        """Stops accepting and cancels every open connection's handler (they close)."""
        if self._accepting is not None:
            self._accepting.cancel()
        self.sock.close()
        tasks = list(self._conns)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_server(endpoint: Endpoint, handler: Handler) -> Server:
    if endpoint.scheme == "unix":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(endpoint.host)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(endpoint.host)
    else:
        sock = socket.socket(_family(endpoint.host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((endpoint.host, endpoint.port))
    sock.listen(128)
    sock.setblocking(False)
    server = Server(sock, handler)
    server.start()
    return server
