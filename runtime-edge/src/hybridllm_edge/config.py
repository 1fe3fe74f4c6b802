"""Edge serving settings: one pydantic-settings model, from flags or ``HYBRIDLLM_EDGE_*``.

The command line is generated from the fields (``--cache-ttl-seconds`` for
``cache_ttl_seconds``), the same scheme as the cloud runtime, so the operator's command line
(``--model --served-model-name --max-model-len --backend --quantization --parallel --port
--cache-ttl-seconds --cache-max-entries | --no-cache``) and Helm values name one setting once.
The fields both runtimes have (model source, served name, listen address, queue bound) come
from ``hybridllm_common.serving.settings.RuntimeSettings``; the rest are the backends'.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from hybridllm_common.serving import settings as settings_mod

Quantization = Literal["f16", "q8_0", "q4_k_m", "q4_0", "q4_1", "fp32", "int8"]

# --quantization -> model store target, per backend. q4_1 is the shipped GGUF itself.
GGUF_TARGETS: dict[str, str] = {
    "q4_1": "gguf",
    "f16": "gguf-f16",
    "q8_0": "gguf-q8_0",
    "q4_k_m": "gguf-q4_k_m",
    "q4_0": "gguf-q4_0",
}
ONNX_TARGETS: dict[str, str] = {"fp32": "onnx", "int8": "onnx-int8"}


class EdgeSettings(settings_mod.RuntimeSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRIDLLM_EDGE_", extra="ignore")

    model: str = Field(
        default=settings_mod.DEFAULT_MODEL,
        description="model store URI, a local .gguf file, or a local ONNX export folder",
    )
    backend: Literal["llamacpp", "onnx"] = Field(
        default="llamacpp", description="inference backend"
    )
    quantization: Quantization | None = Field(
        default=None,
        description="weights variant: f16|q8_0|q4_k_m|q4_0|q4_1 (llamacpp), fp32|int8 (onnx); "
        "default q4_1 for llamacpp, fp32 for onnx",
    )
    ssl_certfile: str | None = Field(
        default=None,
        description="serve HTTPS with this certificate (PEM; with --ssl-keyfile; reloaded "
        "when the file changes, as the device agent renews it)",
    )
    ssl_keyfile: str | None = Field(default=None, description="the certificate's key (PEM)")
    max_model_len: int = Field(default=2048, ge=16, description="context length per request")
    parallel: int = Field(default=4, ge=1, le=64, description="sequences decoded together")
    max_num_batched_tokens: int = Field(
        default=512, ge=16, description="tokens per engine step (prefill is chunked to fit)"
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="CPU threads for the backend (default: half the cores, as llama.cpp)",
    )
    max_waiting_requests: settings_mod.QueueBound = 64  # a device runs a few slots
    cache: bool = Field(default=True, description="response cache for repeated questions")
    cache_ttl_seconds: float = Field(default=300.0, gt=0, description="response cache TTL")
    cache_max_entries: int = Field(default=1024, ge=1, description="response cache size bound")

    @model_validator(mode="after")
    def _tls_pair(self) -> EdgeSettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile go together")
        return self

    def store_target(self) -> str:
        quant = self.quantization or ("q4_1" if self.backend == "llamacpp" else "fp32")
        table = GGUF_TARGETS if self.backend == "llamacpp" else ONNX_TARGETS
        if quant not in table:
            raise ValueError(
                f"quantization {quant!r} does not apply to the {self.backend} backend "
                f"(choose one of {', '.join(table)})"
            )
        return table[quant]
