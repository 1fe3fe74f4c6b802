"""A trivial HTTP/1.1 server that answers every request with the same recorded bytes.

``python bench/edge/replay.py PORT RESPONSE_FILE``: the file holds one complete HTTP
response (status line, headers with ``content-length``, body), recorded from our server's
cache hit. It reads each request (headers and a ``content-length`` body) and writes the
bytes back on the same keep-alive connection, with no framework and no parsing of the
JSON. A client timed against it shows its own cost per call: what remains of an end-to-end
cache hit once the server does nothing at all.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


async def serve(port: int, response: bytes) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2]).read_bytes()))
