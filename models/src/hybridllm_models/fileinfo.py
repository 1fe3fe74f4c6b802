"""Read what a model file is without loading it: validity, parameter count, quantization.

GGUF files are read with the ``gguf`` library (memory-mapped, no weights copied);
safetensors files by their JSON header alone. Both need numpy only, never torch, so
``pull`` and ``verify`` run on edge devices.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from hybridllm_models import errors

GGUF_MAGIC = b"GGUF"


def gguf_summary(path: Path) -> tuple[int, str]:
    """(parameter count, file type such as 'Q4_1') of a GGUF file; IntegrityError if invalid."""
    import gguf

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise errors.IntegrityError(
            f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')"
        )
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
        tensors = list(reader.tensors)
    except (ValueError, IndexError, KeyError, struct.error, OSError) as exc:
        raise errors.IntegrityError(
            f"{path} is not a readable GGUF file (truncated?): {exc}"
        ) from exc
    for tensor in tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise errors.IntegrityError(
                f"{path} is truncated: tensor {tensor.name} ends at byte "
                f"{int(tensor.data_offset) + int(tensor.n_bytes)} but the file has {size} bytes"
            )
    num_params = sum(int(math.prod(int(d) for d in t.shape)) for t in tensors)
    field = reader.get_field("general.file_type")
    if field is None:
        file_type = "unknown"
    else:
        value = int(field.parts[field.data[0]][0])
        try:
            file_type = gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            file_type = f"file_type_{value}"
    return num_params, file_type


def safetensors_header(path: Path) -> dict[str, dict[str, object]]:
    """The tensor table of a safetensors file, read from its header; IntegrityError if malformed."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise errors.IntegrityError(f"{path} is not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise errors.IntegrityError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise errors.IntegrityError(
                f"{path} has a malformed safetensors header: {exc}"
            ) from exc
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        end = int(info["data_offsets"][1])
        if end > data_size:
            raise errors.IntegrityError(f"{path} is truncated: tensor {name} ends past the file")
    return header


def safetensors_summary(paths: list[Path]) -> tuple[int, str]:
    """(parameter count, dtype such as 'f32' or 'bf16') over the shards of one model."""
    num_params = 0
    dtypes: set[str] = set()
    for path in paths:
        for info in safetensors_header(path).values():
            num_params += math.prod(int(d) for d in info["shape"])  # type: ignore[union-attr]
            dtypes.add(str(info["dtype"]).lower())
    dtype = "+".join(sorted(dtypes)) or "unknown"
    return num_params, dtype.replace("float", "f")
