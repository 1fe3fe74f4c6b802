"""The verifier of ``/v1/search``: a second causal LM in the serving process.

Three set-ups, from ``ServeSettings``:

- none given (the default): the served model scores its own candidates in its own engine,
  so scoring batches with generation and shares one KV cache and prefix cache;
- ``--verifier-num-layers N`` alone: the served model's first N layers, sharing its weights,
  in an engine of its own;
- ``--verifier-model``: any causal LM this runtime loads (the Llama family), optionally cut
  to its first ``--verifier-num-layers``; its own tokenizer reads the verifier's text.

A separate verifier gets ``--verifier-kv-fraction`` of the KV budget (the served model the
rest) and an engine thread of its own, with the same failure isolation as the served
model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridllm_cloud import config as config_mod
from hybridllm_cloud import model_path
from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.engine import async_engine, llm_engine
from hybridllm_cloud.model import llama
from hybridllm_cloud.spec_decode import draft as draft_mod


@dataclass
class Verifier:
    """A separate verifier: its engine, and its tokenizer when it differs from the served
    model's (None: same token ids, so steps are scored on the generator's own tokens)."""

    engine: async_engine.AsyncEngine
    tokenizer: tokenizer_mod.Tokenizer | None


def load(
    settings: config_mod.ServeSettings,
    generator: llm_engine.LLMEngine,
) -> tuple[llm_engine.LLMEngine, tokenizer_mod.Tokenizer | None] | None:
    """The separate verifier's engine (None: the served model verifies itself)."""
    if not settings.separate_verifier:
        return None
    cfg = settings.verifier_engine_config()
    layers = settings.verifier_num_layers
    if settings.verifier_model is None:
        assert layers is not None
        model = draft_mod.truncated(generator.model, layers, "verifier_num_layers")
        return llm_engine.LLMEngine(model, generator.tokenizer, cfg), None
    path = model_path.resolve_model_path(settings.verifier_model, settings.verify_model)
    model = llama.load_llama(
        path,
        llm_engine.DTYPES[cfg.dtype],
        torch.device(cfg.device),
        cfg.max_model_len,
        cfg.quantization,
    )
    if layers is not None:
        model = draft_mod.truncated(model, layers, "verifier_num_layers")
    tok = tokenizer_mod.Tokenizer(path)
    return llm_engine.LLMEngine(model, tok, cfg), tok
