"""Serving settings: one pydantic-settings model, read from flags or ``HYBRIDLLM_CLOUD_*``.

The command line is generated from the fields (``--max-num-seqs`` for ``max_num_seqs``),
so a setting exists once, with its description, and is the same from a flag, from the
environment (``HYBRIDLLM_CLOUD_MAX_NUM_SEQS=32``) or from a Helm value. The fields both
runtimes have (model source, served name, listen address, queue bound) come from
``hybridllm_common.serving.settings.RuntimeSettings``; the rest are the engine's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from hybridllm_cloud.spec_decode.config import SpeculativeConfig
from hybridllm_common.serving import settings as settings_mod

if TYPE_CHECKING:  # the engine (torch) loads when a server starts, not for `--help`
    from hybridllm_cloud.engine import llm_engine

DEFAULT_VERIFIER_KV_FRACTION = 0.25


class ServeSettings(settings_mod.RuntimeSettings):
    model_config = SettingsConfigDict(env_prefix="HYBRIDLLM_CLOUD_", extra="ignore")

    model: str = Field(
        default=settings_mod.DEFAULT_MODEL,
        description="model store URI or a local Hugging Face layout directory",
    )
    role: Literal["monolithic", "prefill", "decode"] = Field(
        default="monolithic",
        description="monolithic; prefill (serves remote prefills on --kv-port); decode "
        "(sends long prompts to --prefill-url)",
    )
    kv_port: int = Field(
        default=8001, ge=0, le=65535, description="prefill role: port of the KV transfer server"
    )
    kv_socket: str | None = Field(
        default=None, description="prefill role: also listen on this Unix socket path"
    )
    prefill_url: str | None = Field(
        default=None,
        description="decode role: prefill workers, comma-separated tcp://HOST:PORT or "
        "unix:///PATH (a host name is resolved to all its addresses)",
    )
    local_prefill_threshold: int = Field(
        default=256,
        ge=0,
        description="decode role: prompts with at most this many uncached tokens are "
        "prefilled locally",
    )
    max_remote_prefills_per_worker: int = Field(
        default=8, ge=1, description="decode role: concurrent transfers per prefill worker"
    )
    kv_transfer_timeout_seconds: float = Field(
        default=30.0, gt=0, description="KV transfer: connect and per-frame timeout"
    )
    kv_transfer_retries: int = Field(
        default=1, ge=0, description="decode role: other prefill workers to try after a failure"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weights and KV cache dtype"
    )
    device: str = Field(default="cpu", description="torch device (cpu, cuda, cuda:1)")
    quantization: Literal["none", "w8a16"] = Field(
        default="none",
        description="weights: none, or w8a16 (int8 per-channel weights, 16-bit activations; "
        "needs --dtype bfloat16 or float16)",
    )
    gpu_memory_fraction: float = Field(
        default=0.9,
        ge=0.1,
        le=0.98,
        description="CUDA: share of GPU memory for weights plus KV cache (the KV cache gets the "
        "rest after the weights); on CPU --kv-cache-memory-gib sizes the cache",
    )
    torch_threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads (default: torch's choice)"
    )
    block_size: int = Field(default=16, ge=1, description="tokens per KV block")
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks (default: from kv_cache_memory_gib)"
    )
    kv_cache_memory_gib: float = Field(default=1.0, gt=0, description="memory for the KV cache")
    max_num_batched_tokens: int = Field(default=512, ge=1, description="token budget per step")
    max_num_seqs: int = Field(default=64, ge=1, description="running requests at most")
    max_model_len: int | None = Field(default=None, ge=16, description="context length cap")
    enable_prefix_caching: bool = Field(default=True, description="share KV of equal prefixes")
    enable_chunked_prefill: bool = Field(default=True, description="split long prompts")
    speculative_method: Literal["ngram", "draft"] | None = Field(
        default=None,
        description="speculative decoding: ngram (prompt lookup in the request's own "
        "tokens) or draft (a smaller model of the same tokenizer); off by default",
    )
    num_speculative_tokens: int | None = Field(
        default=None,
        description="speculative decoding: tokens proposed per request and step (k, "
        "default 4); needs --speculative-method",
    )
    ngram_prompt_lookup_max: int | None = Field(
        default=None,
        description="ngram: longest n-gram matched (default 4); needs --speculative-method ngram",
    )
    ngram_prompt_lookup_min: int | None = Field(
        default=None,
        description="ngram: shortest n-gram matched (default 2); needs --speculative-method ngram",
    )
    speculative_draft_model: str | None = Field(
        default=None,
        description="draft: model store URI or Hugging Face layout directory of the draft "
        "(same vocabulary as --model); default: the target's own first "
        "--speculative-draft-num-layers layers",
    )
    speculative_draft_num_layers: int | None = Field(
        default=None,
        description="draft: keep only the first N decoder layers of the draft (of --model "
        "itself when no --speculative-draft-model is given)",
    )

    verifier_model: str | None = Field(
        default=None,
        description="/v1/search: model store URI or Hugging Face layout directory of the "
        "verifier, loaded in this process beside --model; default: --model scores its own "
        "candidates, in the same engine and KV cache",
    )
    verifier_num_layers: int | None = Field(
        default=None,
        ge=1,
        description="/v1/search: keep only the verifier's first N decoder layers (of --model "
        "itself when no --verifier-model is given: it shares the weights)",
    )
    verifier_kv_fraction: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description="/v1/search: the verifier's share of the KV cache budget (default 0.25); "
        "only with --verifier-model or --verifier-num-layers",
    )

    @model_validator(mode="after")
    def _role_needs(self) -> ServeSettings:
        if self.quantization == "w8a16" and self.dtype == "float32":
            raise ValueError("quantization: w8a16 needs --dtype bfloat16 or float16")
        if self.role == "decode" and not self.prefill_url:
            raise ValueError("prefill_url: the decode role needs --prefill-url")
        if self.prefill_url:
            from hybridllm_cloud.disagg import transport

            try:
                transport.parse_endpoints(self.prefill_url)
            except ValueError as exc:
                raise ValueError(f"prefill_url: {exc}") from exc
        self._check_speculative()
        if self.verifier_kv_fraction is not None and not self.separate_verifier:
            raise ValueError(
                "verifier_kv_fraction: only with --verifier-model or --verifier-num-layers "
                "(otherwise the served model verifies in its own cache)"
            )
        if self.separate_verifier and self.role != "monolithic":
            raise ValueError(
                "verifier_model: a verifier is loaded only in the monolithic role "
                f"(not {self.role})"
            )
        if self.separate_verifier and self.num_kv_blocks is not None:
            raise ValueError(
                "num_kv_blocks: with a separate verifier the KV budget is split by memory; "
                "size it with --kv-cache-memory-gib and --verifier-kv-fraction"
            )
        return self

    @property
    def separate_verifier(self) -> bool:
        """A verifier model of its own (a second model and KV cache in this process)."""
        return self.verifier_model is not None or self.verifier_num_layers is not None

    def _kv_bytes(self) -> tuple[int, int]:
        """The KV budget, split between the served model and a separate verifier."""
        total = int(self.kv_cache_memory_gib * (1 << 30))
        if not self.separate_verifier:
            return total, 0
        verifier = int(total * (self.verifier_kv_fraction or DEFAULT_VERIFIER_KV_FRACTION))
        return total - verifier, verifier

    def verifier_engine_config(self) -> llm_engine.EngineConfig:
        """The verifier's engine: the served model's settings, its share of the KV budget,
        no speculation."""
        return dataclasses.replace(
            self.engine_config(),
            kv_cache_memory_bytes=self._kv_bytes()[1],
            speculative=SpeculativeConfig(),
        )

    def _check_speculative(self) -> None:
        """Every speculative flag works or is refused: none is accepted and ignored."""
        given = [
            name
            for name in (
                "num_speculative_tokens",
                "ngram_prompt_lookup_max",
                "ngram_prompt_lookup_min",
                "speculative_draft_model",
                "speculative_draft_num_layers",
            )
            if getattr(self, name) is not None
        ]
        if self.speculative_method is None:
            if given:
                raise ValueError(f"{given[0]}: needs --speculative-method (ngram or draft)")
            return
        if self.role == "prefill":
            raise ValueError(
                "speculative_method: the prefill role computes prompts and one token; "
                "speculation is for the decode or monolithic role"
            )
        if self.speculative_method == "draft":
            for name in ("ngram_prompt_lookup_max", "ngram_prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: only for --speculative-method ngram")
        self.speculative_config().validate()

    def speculative_config(self) -> SpeculativeConfig:
        if self.speculative_method is None:
            return SpeculativeConfig()
        defaults = SpeculativeConfig()

        def pick(value: int | None, default: int) -> int:
            return default if value is None else value

        lookup_max = pick(self.ngram_prompt_lookup_max, defaults.prompt_lookup_max)
        lookup_min = pick(self.ngram_prompt_lookup_min, defaults.prompt_lookup_min)
        if self.ngram_prompt_lookup_max is None:  # only a minimum given: look at least that far
            lookup_max = max(lookup_max, lookup_min)
        elif self.ngram_prompt_lookup_min is None:  # only a maximum given: down to 1..max
            lookup_min = min(lookup_min, lookup_max)
        return SpeculativeConfig(
            method=self.speculative_method,
            num_speculative_tokens=pick(
                self.num_speculative_tokens, defaults.num_speculative_tokens
            ),
            prompt_lookup_max=lookup_max,
            prompt_lookup_min=lookup_min,
            draft_model=self.speculative_draft_model,
            draft_num_layers=self.speculative_draft_num_layers,
        )

    def engine_config(self) -> llm_engine.EngineConfig:
        from hybridllm_cloud.engine import llm_engine

        return llm_engine.EngineConfig(
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_bytes=self._kv_bytes()[0],
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            dtype=self.dtype,
            device=self.device,
            quantization=self.quantization,
            gpu_memory_fraction=self.gpu_memory_fraction,
            local_prefill_threshold=self.local_prefill_threshold,
            speculative=self.speculative_config(),
        )
