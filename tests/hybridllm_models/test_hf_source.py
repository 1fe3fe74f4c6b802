"""hf:// through huggingface_hub, against a local folder laid out like the hub cache.

The cache is ``models--<org>--<name>/{refs/main, snapshots/<commit>/..., blobs/<sha>}`` with
snapshot files as symlinks into blobs, as huggingface_hub writes it. The model is a tiny
random Llama (2 layers, hidden 64) with SmolLM2's real tokenizer, so the HF -> GGUF path
runs on it in seconds.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hybridllm_models import convert, errors
from hybridllm_models.store import Store

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tiny_llama(folder: Path, hf_dir: Path) -> None:
    from safetensors.numpy import save_file

    config = json.loads((hf_dir / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (64,),
            p + "post_attention_layernorm.weight": (64,),
            p + "self_attn.q_proj.weight": (64, 64),
            p + "self_attn.k_proj.weight": (32, 64),
            p + "self_attn.v_proj.weight": (32, 64),
            p + "self_attn.o_proj.weight": (64, 64),
            p + "mlp.gate_proj.weight": (128, 64),
            p + "mlp.up_proj.weight": (128, 64),
            p + "mlp.down_proj.weight": (64, 128),
        }
    save_file(
        {k: (rng.standard_normal(s) * 0.02).astype(np.float32) for k, s in shapes.items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(hf_dir / name, folder / name)


@pytest.fixture
def hub_cache(tmp_path: Path, hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    repo = cache / "models--testorg--tiny-llama"
    staging = tmp_path / "files"
    staging.mkdir()
    _tiny_llama(staging, hf_dir)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for file in staging.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.move(file, blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hf_uri_pulls_from_the_hub_cache(store_root: Path, hub_cache: Path) -> None:
    pulled = Store().pull("hf://testorg/tiny-llama@main")
    m = pulled.manifest
    assert (m.name, m.revision, m.format, m.quantization) == (
        "testorg--tiny-llama",
        "main",
        "safetensors",
        "f32",
    )
    assert pulled.primary_path == pulled.path
    assert not (pulled.path / "config.json").is_symlink()
    assert {f.path for f in m.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert m.parameter_count == 49152 * 64 + 64 + 2 * (
        2 * 64 + 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64
    )


def test_hf_source_converts_to_gguf(store_root: Path, hub_cache: Path, hf_dir: Path) -> None:
    import llama_cpp

    uri = f"hf://testorg/tiny-llama@{COMMIT}"
    assert convert.ensure(uri, "hf") == Store().pull(uri).path
    gguf_path = convert.ensure(uri, "gguf")
    assert gguf_path.name == "model-f16.gguf"
    # logits_all: every evaluated position gets its logits row (otherwise only the last is written)
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=64, verbose=False, n_threads=1, logits_all=True)
    from tokenizers import Tokenizer

    text = "Hello, world! 42 <|im_end|>"
    ours = (
        Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == ours
    llm.eval(ours)
    assert np.isfinite(np.asarray(llm.scores[: len(ours)])).all()


def test_missing_repo_offline_fails_clearly(store_root: Path, hub_cache: Path) -> None:
    with pytest.raises(
        errors.SourceNotFoundError, match=r"HF_HUB_OFFLINE is set.*not in the local hub cache"
    ):
        Store().pull("hf://testorg/absent@main")
    assert list(store_root.glob("*/*/source")) == []


def test_unreachable_hub_fails_clearly(
    store_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(errors.SourceNotFoundError, match="no hub reachable"):
        Store().pull("hf://testorg/absent@main")


def test_conversions_are_cached_by_source_and_target(store_root: Path, hub_cache: Path) -> None:
    uri = f"hf://testorg/tiny-llama@{COMMIT}"
    first = convert.ensure_artifact(uri, "gguf-f16")
    again = convert.ensure_artifact(uri, "gguf-f16")
    assert again.manifest.created_at == first.manifest.created_at
    assert first.manifest.derived_from_sha256 == Store().pull(uri).content_sha256
    rebuilt = convert.ensure_artifact(uri, "gguf-f16", force=True)
    assert rebuilt.manifest.created_at != first.manifest.created_at
    assert [f.sha256 for f in rebuilt.manifest.files] == [f.sha256 for f in first.manifest.files]
