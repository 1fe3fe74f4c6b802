"""What crosses the scheduler / model-runner seam: plain dataclasses only.

These records are the boundary at which prefill and decode will run in separate
processes, so they hold ids, token ids and numbers, never engine objects or tensors. The
engine (``engine/``) writes and reads them, and so do the model runner (``worker/``) and
the speculative decoding pieces (``spec_decode/``): they sit below all three (as vLLM's
``vllm/v1/outputs.py``), next to ``sampling_params.py``, and import nothing of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridllm_cloud.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_position: int  # position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the chunk reaches the last known token: sample the next one
    sampling_params: SamplingParams
    num_output_tokens: int = 0  # generated so far (for penalties / bookkeeping)
    output_token_ids: list[int] | None = None  # generated so far, when penalties need them
    # Speculative decoding: the proposals being verified (the tail of token_ids; the draft
    # model fills them in the runner) and, for the draft, the tokens it has not seen yet
    # (positions draft_start .. start_position, the last one being token_ids[0]).
    spec_token_ids: list[int] = field(default_factory=list)
    draft_start: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs: rows from ``prompt_row`` on predict these prompt tokens (the
    # logprob of prompt_targets[j] is read from the logits of row prompt_row + j).
    prompt_row: int = 0
    prompt_targets: list[int] = field(default_factory=list)
    # Structured output: the tokens this step's sample may take (bool[vocab], from the
    # request's grammar; None: any).
    allowed_tokens: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class KVLoad:
    """Decode role: fill these blocks of a request from a prefill worker."""

    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]  # the prompt's whole block table
    first_block: int  # blocks before it are prefix-cache hits here and are not sent
    sampling_params: SamplingParams


@dataclass
class KVExportSlice:
    """Prefill role: after each layer of this step, ship these blocks of a request."""

    request_id: str
    first_block: int  # index in the request's block table of block_ids[0]
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # since the previous step
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_exports: list[KVExportSlice] = field(default_factory=list)
    # Beam search copy on write: (src, dst) block ids to copy before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    logprob: float  # of the sampled token
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Speculative decoding: per verified request, the tokens emitted (accepted proposals
    # plus one) and their logprobs when asked.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Prompt logprobs computed this step, per request: those of its prompt_targets.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class BeamSequence:
    """A beam search's returned sequence: its tokens (with the EOS that ended it, if any)."""

    token_ids: list[int]
    score: float  # sum of log-probabilities / generated length ** length_penalty
    finish_reason: str  # "stop" | "length"
    stop_reason: int | None = None


@dataclass
class BeamKVStats:
    """Blocks a beam group held at its peak, against what one table per beam would hold."""

    peak_blocks: int = 0  # distinct blocks (shared ones counted once)
    peak_blocks_copy_per_beam: int = 0  # sum of the beams' table lengths
    num_block_copies: int = 0  # copy-on-write block copies issued


@dataclass
class EngineCoreOutput:
    """One request's progress after a step, before detokenisation."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    beams: list[BeamSequence] | None = None  # beam search: the returned sequences, best first
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first token, when asked
    beam_kv: BeamKVStats | None = None
