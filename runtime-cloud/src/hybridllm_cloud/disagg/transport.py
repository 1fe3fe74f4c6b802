"""Where KV bytes travel: endpoints and the transport seam.

The protocol (``protocol.py``) is written against asyncio byte streams, so a transport is
only "how to open a stream to an endpoint and how to accept them":

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
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

STREAM_LIMIT = 1 << 20  # reader buffer; payloads are read with readexactly, not lines


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


async def open_stream(
    endpoint: Endpoint, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if endpoint.scheme == "unix":
        coro = asyncio.open_unix_connection(endpoint.host, limit=STREAM_LIMIT)
    else:
        coro = asyncio.open_connection(endpoint.host, endpoint.port, limit=STREAM_LIMIT)
    reader, writer = await asyncio.wait_for(coro, timeout)
    sock = writer.get_extra_info("socket")
    if sock is not None and endpoint.scheme == "tcp":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def start_server(endpoint: Endpoint, handler: Handler) -> asyncio.Server:
    if endpoint.scheme == "unix":
        return await asyncio.start_unix_server(handler, endpoint.host, limit=STREAM_LIMIT)
    return await asyncio.start_server(
        handler, endpoint.host, endpoint.port, limit=STREAM_LIMIT, reuse_address=True
    )
