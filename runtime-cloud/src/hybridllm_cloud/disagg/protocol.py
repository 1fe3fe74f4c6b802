"""Binary framing of KV transfers between a prefill and a decode worker.

One TCP connection carries one transfer. Every frame is a fixed 40-byte header followed
by a payload::

    magic "HLKV" | version u8 | type u8 | flags u16 | transfer_id u64 |
    layer_start u32 | layer_count u32 | first_block u32 | num_blocks u32 |
    payload_len u64 | crc32(payload) u32                       (network byte order)

Frame types:

- ``PREFILL`` (decode -> prefill): JSON: prompt token ids, sampling parameters for the
  first token, ``first_block`` (blocks before it are cached on the decode side and are not
  sent) and the decode side's cache layout, which the prefill side checks against its own;
  and ``authorization`` (``Bearer <the service's backend token>``), required when the
  prefill side has a token (refused with a non-retryable ``ERROR`` otherwise).
- ``KV`` (prefill -> decode): the K and V of blocks ``[first_block, first_block +
  num_blocks)`` of the request's block table for layers ``[layer_start, layer_start +
  layer_count)``: per layer, K blocks then V blocks, raw in the cache dtype, each block
  ``[block_size, num_kv_heads, head_dim]``. A block may be sent more than once (a chunked
  prefill re-sends the block it left half full); the last copy wins.
- ``DONE`` (prefill -> decode): JSON: the first sampled token, its logprobs, the request's
  random generator state (so seeded sampling continues exactly as in one process) and
  prefill-side timings. Every KV frame of the transfer precedes it.
- ``ERROR`` (prefill -> decode): JSON ``{"message", "retryable"}``; ``retryable`` false
  means another prefill worker would fail the same way (e.g. a layout mismatch).

The checksum covers the payload; a mismatch fails the transfer (and the decode side
retries it elsewhere). Frames are at most ``MAX_PAYLOAD`` bytes, so a corrupt length cannot
make a reader allocate without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import socket
import struct
import zlib
from dataclasses import dataclass
from typing import Any

MAGIC = b"HLKV"
VERSION = 1
HEADER = struct.Struct("!4sBBHQIIIIQI")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 1 << 31


class FrameType(enum.IntEnum):
    PREFILL = 1
    KV = 2
    DONE = 3
    ERROR = 4


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame (bad magic, checksum, size)."""


@dataclass(frozen=True)
class Frame:
    type: FrameType
    transfer_id: int
    payload: bytes | memoryview = b""
    layer_start: int = 0
    layer_count: int = 0
    first_block: int = 0
    num_blocks: int = 0

    def json(self) -> dict[str, Any]:
        value = json.loads(bytes(self.payload))
        if not isinstance(value, dict):
            raise ProtocolError(f"{self.type.name} payload is not a JSON object")
        return value


def encode_header(frame: Frame, crc: int | None = None) -> bytes:
    payload_len = len(frame.payload)
    if payload_len > MAX_PAYLOAD:
        raise ValueError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(
        MAGIC,
        VERSION,
        int(frame.type),
        0,
        frame.transfer_id,
        frame.layer_start,
        frame.layer_count,
        frame.first_block,
        frame.num_blocks,
        payload_len,
        zlib.crc32(frame.payload) if crc is None else crc,
    )


def json_frame(type_: FrameType, transfer_id: int, obj: dict[str, Any]) -> Frame:
    return Frame(type_, transfer_id, json.dumps(obj, separators=(",", ":")).encode())


class Conn:
    """One transfer's socket, framed, on the running asyncio loop.

    Frames go through ``loop.sock_sendall`` / ``loop.sock_recv_into`` on the raw
    non-blocking socket: a payload is received straight into one preallocated buffer (no
    stream buffer growing and shrinking around megabyte frames, about 3x the throughput of
    asyncio streams on loopback), and ``send`` returns only when the kernel took the bytes,
    which is the back-pressure the prefill side relies on.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._header = bytearray(HEADER_SIZE)

    async def send(self, frame: Frame) -> None:
        await self.loop.sock_sendall(self.sock, encode_header(frame))
        if len(frame.payload):
            await self.loop.sock_sendall(self.sock, frame.payload)

    async def send_raw(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))
            got += n

    async def recv(self) -> Frame:
        """One frame; ``asyncio.IncompleteReadError`` at EOF, ``ProtocolError`` if invalid."""
        await self._fill(memoryview(self._header))
        (
            magic,
            version,
            type_,
            _flags,
            transfer_id,
            layer_start,
            layer_count,
            first_block,
            num_blocks,
            payload_len,
            crc,
        ) = HEADER.unpack(self._header)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {magic!r}: not a hybridllm KV stream")
        if version != VERSION:
            raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
        try:
            ftype = FrameType(type_)
        except ValueError as exc:
            raise ProtocolError(f"unknown frame type {type_}") from exc
        if payload_len > MAX_PAYLOAD:
            raise ProtocolError(f"frame of {payload_len} bytes exceeds {MAX_PAYLOAD}")
        payload = bytearray(payload_len)
        if payload_len:
            await self._fill(memoryview(payload))
        if zlib.crc32(payload) != crc:
            raise ProtocolError(
                f"checksum mismatch in {ftype.name} frame (layer {layer_start}, block {first_block})"
            )
        return Frame(ftype, transfer_id, payload, layer_start, layer_count, first_block, num_blocks)

    async def wait_closed_by_peer(self) -> None:
        """Returns when the peer closes or resets the connection (it never sends after PREFILL)."""
        buf = bytearray(1)
        with contextlib.suppress(OSError):
            while await self.loop.sock_recv_into(self.sock, buf):
                pass

    def close(self) -> None:
        self.sock.close()

    def abort(self) -> None:
        """Closes with a reset (RST), as a crashed process would."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def cache_layout(
    num_layers: int, block_shape: tuple[int, ...], dtype: str, model: str
) -> dict[str, Any]:
    """What both sides must agree on before blocks can move (checked by the prefill side)."""
    return {
        "num_layers": num_layers,
        "block_shape": list(block_shape),
        "dtype": dtype,
        "model": model,
    }


def tensor_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
