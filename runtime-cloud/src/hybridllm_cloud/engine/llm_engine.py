"""The synchronous engine: one ``step()`` = schedule, run the model, update, detokenise.

This is the monolithic role: scheduler, model runner and output processing in one
process. Values discovered at load time (number of KV blocks, EOS ids, context length)
land in ``EngineInfo``, never back in the config. Stop strings are matched here, on the
detokenised text, and end the request through the scheduler like an abort; while a
request runs, the last ``len(longest stop) - 1`` characters are held back so a stream
never shows the beginning of a stop string.

Roles (``--role``) are one engine with two extra seams, not separate engines; the server
wires them (``server/app.py``):

- ``decode``: ``connector`` (a ``disagg.connector.RemotePrefillClient``) is asked to fill the
  blocks of every ``KVLoad`` the scheduler emits; it reports back from its own thread
  through ``_on_remote_done``, and the next step turns the result into the request's first
  token (or, on failure, a local prefill). Prompts with at most ``local_prefill_threshold``
  uncached tokens, or any prompt while the prefill pool has no capacity, stay local.
- ``prefill``: a request added with ``kv_export`` has its blocks handed, layer by layer, to
  an ``ExportSink`` (the KV server's per-transfer queue); a sink that refuses (its peer is
  gone or too slow) aborts the request at the end of the step.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.engine import block_pool, kv_cache_manager, scheduler
from hybridllm_cloud.engine.beam_search import BeamGroup, BeamKVStats
from hybridllm_cloud.engine.outputs import EngineCoreOutput, KVLoad, TokenLogprobs
from hybridllm_cloud.engine.request import (
    KVExport,
    Priority,
    Request,
    RequestStatus,
    SamplingParams,
)
from hybridllm_cloud.model import llama
from hybridllm_cloud.spec_decode import draft as draft_mod
from hybridllm_cloud.spec_decode import ngram
from hybridllm_cloud.spec_decode.config import SpeculativeConfig, check_draft
from hybridllm_cloud.worker import model_runner
from hybridllm_common import openai_protocol as oai
from hybridllm_common import structured

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


class ExportSink(Protocol):
    """Prefill role: receives a request's blocks after each layer (engine thread)."""

    def put(self, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """False: the transfer is gone (peer closed, timed out); abort the request."""
        ...


@dataclass
class RemotePrefillResult:
    token: int
    logprobs: TokenLogprobs | None = None
    generator_state: torch.Tensor | None = None


class RemotePrefill(Protocol):
    """Decode role: what the engine needs of the prefill pool (see disagg.connector)."""

    def has_capacity(self) -> bool: ...

    def start(
        self, load: KVLoad, done: Callable[[str, RemotePrefillResult | None], None]
    ) -> None: ...

    def cancel(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kernels_backend: str


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]  # all generated so far
    text: str  # all generated text released so far
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    generator_state: torch.Tensor | None = None  # prefill role: seeded requests, when finished
    # Beam search: the returned sequences, best first (the fields above are the best one's),
    # and the blocks the group held against one table per beam.
    sequences: list[SequenceOutput] | None = None
    beam_kv: BeamKVStats | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs), of positions prompt_logprobs_start..:
    # with the first output only.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Logprobs (SamplingParams.logprobs) of every generated token: on the final output only.
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class SequenceOutput:
    """One sequence of a beam search, detokenised."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    score: float  # cumulative log-probability / length ** length_penalty (HF's)


@dataclass
class _OutputState:
    detok: tokenizer_mod.IncrementalDetokenizer | None
    stop: tuple[str, ...]
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    released: int = 0  # characters of detok.text already returned
    logprobs: list[TokenLogprobs] | None = None  # all so far, when the request asked


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
        # The draft's cache is indexed by the same block ids: a block costs both.
        per_block = model_runner.kv_bytes_per_block(model, config.block_size)
        if draft_model is not None:
            per_block += model_runner.kv_bytes_per_block(draft_model, config.block_size)
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
        self._outputs: dict[str, _OutputState] = {}
        self._last_batch = (0, 0)
        # Disaggregation seams (see the module docstring).
        self.connector: RemotePrefill | None = None
        self.notify: Callable[[], None] | None = None  # wakes the thread running step()
        self._remote_done: queue.SimpleQueue[tuple[str, RemotePrefillResult | None]] = (
            queue.SimpleQueue()
        )
        self._remote_event = threading.Event()
        self._export_sinks: dict[str, ExportSink] = {}
        self._failed_exports: set[str] = set()
        self.runner.kv_export_sink = self._export
        self.num_remote_prefills = 0
        self.num_local_prefills = 0
        self.num_remote_failures = 0
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
            self.connector is not None
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
            self._export_sinks[request_id] = kv_export[1]
        detok = None
        if self.tokenizer is not None:
            detok = tokenizer_mod.IncrementalDetokenizer(
                self.tokenizer, prompt_tail=list(prompt_token_ids[-5:])
            )
        self._outputs[request_id] = _OutputState(
            detok,
            params.stop,
            len(prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
        )

    def _beam_group(self, params: SamplingParams, prompt_len: int) -> BeamGroup:
        stop_ids = () if params.ignore_eos else self.info.eos_token_ids
        stop_ids = tuple(dict.fromkeys([*stop_ids, *params.stop_token_ids]))
        max_new = min(params.max_tokens, self.info.max_model_len - prompt_len)
        return BeamGroup(params, prompt_len, stop_ids, max_new, share_kv=self._beam_share_kv)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self.scheduler.remote and self.connector is not None:
                self.connector.cancel(request_id)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._outputs.pop(request_id, None)
            self._export_sinks.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def has_schedulable(self) -> bool:
        return self.scheduler.has_schedulable() or not self._remote_done.empty()

    # --- disaggregation ---------------------------------------------------------------------

    def use_remote_prefill(self, connector: RemotePrefill) -> None:
        """Decode role: long prompts are prefilled by ``connector``'s workers."""
        self.connector = connector
        threshold = self.config.local_prefill_threshold

        def decide(request: Request, num_uncached: int) -> bool:
            """Asked once per request, at its first admission attempt."""
            request.allow_remote_prefill = False
            remote = num_uncached > threshold and connector.has_capacity()
            if not remote:
                self.num_local_prefills += 1
            return remote

        self.scheduler.remote_prefill = decide

    def _on_remote_done(self, request_id: str, result: RemotePrefillResult | None) -> None:
        """Called by the connector's thread when a transfer has ended (and stopped writing)."""
        self._remote_done.put((request_id, result))
        self._remote_event.set()
        if self.notify is not None:
            self.notify()

    def _drain_remote(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while True:
            try:
                request_id, result = self._remote_done.get_nowait()
            except queue.Empty:
                return outputs
            if result is None:
                self.num_remote_failures += 1
                self.scheduler.fail_remote_prefill(request_id)
                continue
            self.num_remote_prefills += 1
            core = self.scheduler.finish_remote_prefill(request_id, result.token, result.logprobs)
            if core is None:
                continue
            if result.generator_state is not None and core.finish_reason is None:
                try:
                    self.runner.set_generator_state(request_id, result.generator_state)
                except (RuntimeError, ValueError) as exc:  # e.g. prefill ran on another device
                    log.warning("%s: generator state not usable (%s); reseeding", request_id, exc)
            outputs.append(core)

    def _export(
        self, request_id: str, layer: int, first_block: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        sink = self._export_sinks.get(request_id)
        if (
            sink is not None
            and request_id not in self._failed_exports
            and not sink.put(layer, first_block, k, v)
        ):
            self._failed_exports.add(request_id)

    # --- one step -------------------------------------------------------------------------

    def _propose(self) -> None:
        """Speculative decoding: proposals for every running request in decode.

        n-gram proposals are made here, on the full token history; a draft model's are
        made in the runner once the step is scheduled, so here its ``k`` slots are only
        reserved (the scheduler trims them to what the request may still emit).
        """
        spec = self.config.speculative
        k = spec.num_speculative_tokens
        for request in self.scheduler.running:
            if request.num_tokens - request.num_computed_tokens != 1 or request.beam_group:
                continue  # mid-prefill, or a beam search (its rows are the choices)
            if request.grammar is not None:
                # Structured output is not speculated: a proposal would need the grammar's
                # mask at every proposed position (llguidance can, per draft token), and
                # the drafts of a constrained answer are mostly forced tokens anyway.
                continue
            if spec.method == "ngram":
                request.spec_token_ids = ngram.propose(
                    request.all_token_ids(), k, spec.prompt_lookup_max, spec.prompt_lookup_min
                )
            else:
                request.spec_token_ids = [draft_mod.PLACEHOLDER] * k

    def step(self) -> list[RequestOutput]:
        core_outputs = self._drain_remote()
        if self.config.speculative.enabled:
            self._propose()
        sched = self.scheduler.schedule()
        self._last_batch = (len(sched.scheduled), sched.total_num_scheduled_tokens)
        if sched.kv_loads:
            assert self.connector is not None
            for load in sched.kv_loads:
                self.connector.start(load, self._on_remote_done)
        result = self.runner.execute(sched)
        core_outputs += self.scheduler.update_from_output(sched, result)
        if self._failed_exports:
            failed = list(self._failed_exports)
            self._failed_exports.clear()
            log.warning("KV export failed for %s: aborting", ", ".join(failed))
            self.abort(failed)
            core_outputs = [c for c in core_outputs if c.request_id not in failed]
        return self._process(core_outputs)

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for core in core_outputs:
            state = self._outputs.get(core.request_id)
            if state is None:
                continue
            if core.beams is not None:
                del self._outputs[core.request_id]
                outputs.append(self._beam_output(core, state))
                continue
            finish, stop_reason = core.finish_reason, core.stop_reason
            new_ids, new_logprobs = core.new_token_ids, core.logprobs
            if state.detok is not None:
                # One token at a time: a speculative step emits several, and a stop string
                # completed by one of them ends the output at that token, as without it.
                for j, token in enumerate(core.new_token_ids):
                    state.detok.push(token)
                    hit = self._match_stop(state) if state.stop else None
                    if hit is not None:
                        if finish is None:
                            self.scheduler.finish_requests(
                                [core.request_id], RequestStatus.FINISHED_STOPPED
                            )
                        finish, stop_reason = "stop", hit
                        new_ids, new_logprobs = new_ids[: j + 1], new_logprobs[: j + 1]
                        break
            state.token_ids.extend(new_ids)
            if state.logprobs is not None:
                state.logprobs.extend(new_logprobs)
            text = state.detok.text if state.detok is not None else ""
            release_to = len(text)
            if finish is None and state.stop:
                release_to = max(state.released, len(text) - max(map(len, state.stop)) + 1)
            new_text = text[state.released : release_to]
            state.released = release_to
            outputs.append(
                RequestOutput(
                    request_id=core.request_id,
                    new_token_ids=new_ids,
                    new_text=new_text,
                    token_ids=list(state.token_ids),
                    text=text[:release_to],
                    finished=finish is not None,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    new_logprobs=new_logprobs,
                    num_prompt_tokens=state.num_prompt_tokens,
                    num_cached_tokens=core.num_cached_tokens,
                    prompt_logprobs=core.prompt_logprobs,
                )
            )
            if finish is not None:
                outputs[-1].logprobs = state.logprobs
                del self._outputs[core.request_id]
                if self._export_sinks.pop(core.request_id, None) is not None:
                    outputs[-1].generator_state = self.runner.generator_state(core.request_id)
        return outputs

    def _beam_output(self, core: EngineCoreOutput, state: _OutputState) -> RequestOutput:
        """A finished beam search: every returned sequence, detokenised whole."""
        assert core.beams is not None
        tok = self.tokenizer
        seqs = [
            SequenceOutput(
                token_ids=b.token_ids,
                text=tok.decode(b.token_ids) if tok is not None else "",
                finish_reason=b.finish_reason,
                stop_reason=b.stop_reason,
                score=b.score,
            )
            for b in core.beams
        ]
        best = seqs[0]
        return RequestOutput(
            request_id=core.request_id,
            new_token_ids=list(best.token_ids),
            new_text=best.text,
            token_ids=list(best.token_ids),
            text=best.text,
            finished=True,
            finish_reason=best.finish_reason,
            stop_reason=best.stop_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_tokens=core.num_cached_tokens,
            sequences=seqs,
            beam_kv=core.beam_kv,
        )

    @staticmethod
    def _match_stop(state: _OutputState) -> str | None:
        """Truncates the text at the first stop string; returns the string that matched."""
        assert state.detok is not None
        text = state.detok.text
        window = max(map(len, state.stop), default=0) + 16
        start = max(0, state.released - window)
        best: tuple[int, str] | None = None
        for stop in state.stop:
            idx = text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        state.detok.text = text[: best[0]]
        state.released = min(state.released, best[0])
        return best[1]

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
            num_remote_prefills=self.num_remote_prefills,
            num_local_prefills=self.num_local_prefills,
            num_remote_failures=self.num_remote_failures,
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
