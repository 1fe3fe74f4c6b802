"""The synchronous engine: one ``step()`` = schedule, run the model, update, detokenise.

This is the monolithic role: scheduler, model runner and output processing in one
process. Values discovered at load time (number of KV blocks, EOS ids, context length)
land in ``EngineInfo``, never back in the config.

Roles (``--role``) are one engine with two extra seams, not separate engines: a decode
engine has long prompts prefilled by a prefill pool, a prefill engine exports a request's
blocks as it computes them (``kv_transfer.py``; the server wires them, ``server/app.py``).

Where each part lives:

- here: ``LLMEngine`` (loading, adding and aborting requests, the step, stats, and
  ``generate`` for offline use), its config, load-time info and stats;
- ``output_processor.py``: a step's outputs made ``RequestOutput``s: detokenisation, stop
  strings (matched on the text, with the last characters held back while a request runs),
  a beam search's sequences;
- ``kv_transfer.py``: ``KVTransfers``, the decode role's remote prefills and the prefill
  role's exports (``RemotePrefill``, ``RemotePrefillResult``, ``ExportSink``);
- ``speculation.py``: the proposals made before each step (speculative decoding);
- ``scheduler.py`` the scheduler, ``async_engine.py`` this engine in its own thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.engine import block_pool, kv_cache_manager, scheduler, speculation
from hybridllm_cloud.engine.beam_search import BeamGroup
from hybridllm_cloud.engine.kv_transfer import (
    ExportSink,
    KVTransfers,
    RemotePrefill,
    RemotePrefillResult,
)
from hybridllm_cloud.engine.output_processor import OutputProcessor, RequestOutput, SequenceOutput
from hybridllm_cloud.engine.request import KVExport, Priority, Request, RequestStatus
from hybridllm_cloud.model import kv_cache, llama
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.spec_decode import draft as draft_mod
from hybridllm_cloud.spec_decode.config import SpeculativeConfig, check_draft
from hybridllm_cloud.worker import model_runner
from hybridllm_common import openai_protocol as oai
from hybridllm_common import structured

# Names other modules and tests know from here; the seams' and the outputs' are re-exported.
__all__ = [
    "DTYPES",
    "EngineConfig",
    "EngineInfo",
    "EngineStats",
    "ExportSink",
    "LLMEngine",
    "RemotePrefill",
    "RemotePrefillResult",
    "RequestOutput",
    "SequenceOutput",
]

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"  # none | w8a16
    gpu_memory_fraction: float = 0.9  # CUDA: weights + KV cache share of the GPU
    local_prefill_threshold: int = 256  # decode role: uncached prompt tokens kept local
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # off by default


@dataclass(frozen=True)
class EngineInfo:
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kernels_backend: str


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    last_batch_size: int
    last_num_tokens: int
    num_remote_waiting: int = 0
    num_remote_prefills: int = 0
    num_local_prefills: int = 0
    num_remote_failures: int = 0
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class LLMEngine:
    def __init__(
        self,
        model: llama.LlamaModel,
        tokenizer: tokenizer_mod.Tokenizer | None,
        config: EngineConfig,
        draft_model: llama.LlamaModel | None = None,
    ) -> None:
        """``draft_model``: the draft of ``config.speculative`` when the caller loaded it
        (``from_path`` does); otherwise a truncated-layer draft is cut from ``model``."""
        from hybridllm_kernels import ops

        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        max_len = config.max_model_len or model.config.max_position_embeddings
        max_len = min(max_len, model.config.max_position_embeddings)
        spec = config.speculative
        spec.validate()
        if spec.uses_draft and draft_model is None:
            if spec.draft_model is not None:
                raise ValueError(
                    "speculative_draft_model: load the draft with LLMEngine.from_path, or "
                    "pass draft_model"
                )
            draft_model = draft_mod.load_draft(spec, model, model.dtype, max_len)
        if draft_model is not None:
            if not spec.uses_draft:
                raise ValueError("draft_model: given without speculative method 'draft'")
            check_draft(model.config.vocab_size, draft_model.config.vocab_size, 1, None)
        self.draft_model = draft_model
        num_blocks, max_len = _kv_cache_size(model, draft_model, config, max_len)
        eos = model.config.eos_token_ids
        if tokenizer is not None:
            eos = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *eos]))
        self.info = EngineInfo(num_blocks, config.block_size, max_len, eos, ops.backend_name())
        pool = block_pool.BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.kv = kv_cache_manager.KVCacheManager(pool, config.block_size)
        self.scheduler = scheduler.Scheduler(
            scheduler.SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                spec_draft=spec.uses_draft,
            ),
            self.kv,
        )
        self.runner = model_runner.ModelRunner(model, num_blocks, config.block_size)
        if draft_model is not None:
            self.runner.drafter = draft_mod.DraftRunner(draft_model, num_blocks, config.block_size)
        self.output_processor = OutputProcessor(tokenizer, self._stop_request)
        self._last_batch = (0, 0)
        # Disaggregation seams (kv_transfer.py).
        self.notify: Callable[[], None] | None = None  # wakes the thread running step()
        self._remote_event = threading.Event()  # wakes generate()
        self.transfers = KVTransfers(
            self.scheduler, self.runner, config.local_prefill_threshold, self._wake
        )
        # Private: False turns beam KV sharing off (the benchmark's copy-per-beam baseline).
        self._beam_share_kv = True
        log.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d, kernels %s%s",
            num_blocks,
            config.block_size,
            max_len,
            self.info.kernels_backend,
            f", speculative {spec.method} k={spec.num_speculative_tokens}" if spec.enabled else "",
        )

    @classmethod
    def from_path(cls, path: Path, config: EngineConfig) -> LLMEngine:
        config.speculative.validate()  # before loading anything
        model = llama.load_llama(
            path,
            DTYPES[config.dtype],
            torch.device(config.device),
            config.max_model_len,
            config.quantization,
        )
        draft = None
        spec = config.speculative
        if spec.uses_draft and spec.draft_model is not None:
            max_len = min(
                config.max_model_len or model.config.max_position_embeddings,
                model.config.max_position_embeddings,
            )
            draft = draft_mod.load_draft(
                spec, model, DTYPES[config.dtype], max_len, config.quantization
            )
        return cls(model, tokenizer_mod.Tokenizer(path), config, draft)

    @functools.cached_property
    def vocabulary(self) -> structured.Vocabulary:
        """The model's tokens for structured output (built at the first such request)."""
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        return structured.Vocabulary.from_tokenizer_json(
            (self.tokenizer.path / "tokenizer.json").read_text(),
            self.model.config.vocab_size,
            list(self.info.eos_token_ids),
        )

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        kv_export: tuple[int, ExportSink] | None = None,
        grammar: structured.Matcher | None = None,
    ) -> None:
        """``kv_export=(first_block, sink)``: prefill role, ship the blocks from there on.
        ``grammar``: the matcher of ``params.constraint``, built by the caller off the step
        loop (a large schema compiles in milliseconds); built here when not given."""
        params.validate()
        request = Request(
            request_id, list(prompt_token_ids), params, self.info.eos_token_ids, priority
        )
        # Prompt logprobs are computed where the prompt is: here; so is the first token of a
        # structured answer (its grammar's matcher lives here).
        request.allow_remote_prefill = (
            self.transfers.connector is not None
            and params.prompt_logprobs is None
            and params.constraint is None
        )
        if params.constraint is not None:
            try:
                request.grammar = grammar or self.vocabulary.matcher(params.constraint)
            except oai.APIError as exc:
                raise ValueError(exc.message) from exc
        if params.prompt_logprobs is not None and params.prompt_logprobs_start >= len(
            prompt_token_ids
        ):
            raise ValueError(
                f"prompt_logprobs_start: {params.prompt_logprobs_start} is not a position of the "
                f"prompt of {len(prompt_token_ids)} tokens"
            )
        if kv_export is not None:
            request.kv_export = KVExport(first_block=kv_export[0])
        if params.use_beam_search:
            if params.beam_width > self.config.max_num_batched_tokens:
                raise ValueError(
                    f"best_of: a beam width of {params.beam_width} exceeds the step's token "
                    f"budget of {self.config.max_num_batched_tokens}"
                )
            request.beam_group = self._beam_group(params, len(prompt_token_ids))
            worst = request.beam_group.worst_case_blocks(self.info.block_size)
            if worst > self.info.num_kv_blocks:
                raise ValueError(
                    f"best_of: {params.beam_width} beams of up to "
                    f"{len(prompt_token_ids) + request.beam_group.max_new} tokens may need "
                    f"{worst} KV blocks after a preemption, more than the cache's "
                    f"{self.info.num_kv_blocks}; lower best_of or max_tokens"
                )
            request.allow_remote_prefill = False  # the prompt's end is a beam step, done here
            if kv_export is not None:
                raise ValueError("use_beam_search: not supported on a prefill worker")
        self.scheduler.add_request(request)
        if kv_export is not None:
            self.transfers.sinks[request_id] = kv_export[1]
        self.output_processor.add_request(request_id, prompt_token_ids, params)

    def _beam_group(self, params: SamplingParams, prompt_len: int) -> BeamGroup:
        stop_ids = () if params.ignore_eos else self.info.eos_token_ids
        stop_ids = tuple(dict.fromkeys([*stop_ids, *params.stop_token_ids]))
        max_new = min(params.max_tokens, self.info.max_model_len - prompt_len)
        return BeamGroup(params, prompt_len, stop_ids, max_new, share_kv=self._beam_share_kv)

    def abort(self, request_ids: list[str]) -> None:
        self.transfers.cancel(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self.output_processor.abort(request_id)
            self.transfers.sinks.pop(request_id, None)

    def _stop_request(self, request_id: str) -> None:
        """Its text reached a stop string (the output processor's callback)."""
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def has_schedulable(self) -> bool:
        return self.scheduler.has_schedulable() or self.transfers.has_results()

    # --- disaggregation (kv_transfer.py) ----------------------------------------------------

    def use_remote_prefill(self, connector: RemotePrefill) -> None:
        """Decode role: long prompts are prefilled by ``connector``'s workers."""
        self.transfers.use_remote_prefill(connector)

    def _wake(self) -> None:
        """A remote prefill has ended (the connector's thread): wakes the step's caller."""
        self._remote_event.set()
        if self.notify is not None:
            self.notify()

    @property
    def num_remote_prefills(self) -> int:
        return self.transfers.num_remote_prefills

    @property
    def num_local_prefills(self) -> int:
        return self.transfers.num_local_prefills

    @property
    def num_remote_failures(self) -> int:
        return self.transfers.num_remote_failures

    # --- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        core_outputs = self.transfers.drain()
        if self.config.speculative.enabled:
            speculation.propose(self.scheduler.running, self.config.speculative)
        sched = self.scheduler.schedule()
        self._last_batch = (len(sched.scheduled), sched.total_num_scheduled_tokens)
        if sched.kv_loads:
            self.transfers.start(sched.kv_loads)
        result = self.runner.execute(sched)
        core_outputs += self.scheduler.update_from_output(sched, result)
        failed = self.transfers.take_failed_exports()
        if failed:
            log.warning("KV export failed for %s: aborting", ", ".join(failed))
            self.abort(failed)
            core_outputs = [c for c in core_outputs if c.request_id not in failed]
        outputs = self.output_processor.process(core_outputs)
        for out in outputs:  # prefill role: a finished request's sampler state goes along
            if out.finished and self.transfers.sinks.pop(out.request_id, None) is not None:
                out.generator_state = self.runner.generator_state(out.request_id)
        return outputs

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_free=pool.num_free_blocks,
            prefix_cache_queries=self.kv.num_query_tokens,
            prefix_cache_hits=self.kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            last_batch_size=self._last_batch[0],
            last_num_tokens=self._last_batch[1],
            num_remote_waiting=len(self.scheduler.remote),
            num_remote_prefills=self.transfers.num_remote_prefills,
            num_local_prefills=self.transfers.num_local_prefills,
            num_remote_failures=self.transfers.num_remote_failures,
            num_spec_drafts=self.scheduler.num_spec_drafts,
            num_spec_draft_tokens=self.scheduler.num_spec_draft_tokens,
            num_spec_accepted_tokens=self.scheduler.num_spec_accepted_tokens,
        )

    # --- offline use (tests, benchmarks) --------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Runs requests to completion; returns the final output of each, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            if not self.has_schedulable():  # only remote prefills in flight
                self._remote_event.wait(timeout=1.0)
                self._remote_event.clear()
                continue
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


def _kv_cache_size(
    model: llama.LlamaModel,
    draft_model: llama.LlamaModel | None,
    config: EngineConfig,
    max_len: int,
) -> tuple[int, int]:
    """The KV blocks the cache gets (``num_kv_blocks``, or as many as its memory holds),
    and ``max_len`` capped to the tokens they hold."""
    # The draft's cache is indexed by the same block ids: a block costs both.
    per_block = kv_cache.kv_bytes_per_block(model, config.block_size)
    if draft_model is not None:
        per_block += kv_cache.kv_bytes_per_block(draft_model, config.block_size)
    kv_bytes = config.kv_cache_memory_bytes
    if model.device.type == "cuda" and config.num_kv_blocks is None:
        total = torch.cuda.get_device_properties(model.device).total_memory
        kv_bytes = int(config.gpu_memory_fraction * total) - torch.cuda.memory_allocated(
            model.device
        )
        if kv_bytes < per_block:
            raise ValueError(
                f"gpu_memory_fraction {config.gpu_memory_fraction} leaves no room for the KV "
                "cache after the weights"
            )
    num_blocks = config.num_kv_blocks or kv_bytes // per_block
    if num_blocks * config.block_size < max_len:
        log.warning(
            "KV cache of %d blocks holds %d tokens, less than max_model_len %d: capping it",
            num_blocks,
            num_blocks * config.block_size,
            max_len,
        )
        max_len = num_blocks * config.block_size
    return num_blocks, max_len
