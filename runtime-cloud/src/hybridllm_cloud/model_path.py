"""Where a model's weights are: a local Hugging Face layout directory, or the model store.

Below both the server (the served model) and the search's verifier (a second model in the
same process), which both load a model from ``--model``-style sources.
"""

from __future__ import annotations

from pathlib import Path


def resolve_model_path(model: str, verify: bool = True, sha256: str | None = None) -> Path:
    """A local HF-layout directory as is; anything else through the model store, its
    files re-hashed against the manifest when ``verify`` (a corrupt artifact raises
    ``hybridllm_models.IntegrityError``)."""
    path = Path(model)
    if path.is_dir():
        return path
    import hybridllm_models

    return Path(hybridllm_models.ensure(model, target="hf", verify=verify, expected_sha256=sha256))
