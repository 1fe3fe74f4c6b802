"""The floor for any proxy in its own Python process: a TCP relay that does nothing else.

Each client connection gets one backend connection, and bytes are written across from
``data_received`` in both directions (uvloop, ``asyncio.Protocol``; no HTTP parsing, no
auth, no routing). Measured beside the gateway, it shows what the extra process hop and
the per-chunk socket calls cost on this machine by themselves: whatever the gateway adds
on top of it is the gateway's own work.

    python bench/gateway/nullproxy.py --port 9100 --backend 127.0.0.1:9001
"""

from __future__ import annotations

import argparse
import asyncio
import typing


class Pipe(asyncio.Protocol):
    def __init__(self, peer: Pipe | None = None) -> None:
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def serve(port: int, backend: tuple[str, int]) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task[None]] = set()

    def client() -> Pipe:
        down = Pipe()

        async def connect() -> None:
            try:
                _, up = await loop.create_connection(lambda: Pipe(down), *backend)
            except OSError:
                if down.transport is not None:
                    down.transport.close()
                return
            down.peer = up
            for data in down.pending:
                up.transport.write(data)  # type: ignore[union-attr]
            down.pending.clear()

        task = loop.create_task(connect())
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return down

    server = await loop.create_server(client, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", required=True, help="host:port")
    a = p.parse_args()
    host, port = a.backend.rsplit(":", 1)
    import uvloop

    uvloop.run(serve(a.port, (host, int(port))))


if __name__ == "__main__":
    main()
