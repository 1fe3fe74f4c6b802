"""A request as the engine sees it: token ids, sampling parameters and progress.

The scheduler owns request objects; the model runner never sees them (it receives plain
``ScheduledRequest`` records, ``hybridllm_cloud/outputs.py``), so this module is the
engine's, while the ``SamplingParams`` both sides read sit below both
(``hybridllm_cloud/sampling_params.py``). ``num_computed_tokens`` counts tokens whose K/V
are in the cache; preemption by recompute resets it to 0 and keeps the generated tokens,
which are then recomputed as if they were part of the prompt.

Disaggregation adds two things: on a decode worker a request may wait in
``WAITING_FOR_REMOTE_KV`` while a prefill worker fills its blocks (it holds them, but is
neither waiting nor running); on a prefill worker ``kv_export`` marks a request whose
blocks, from ``kv_export.first_block`` on, are shipped layer by layer as they are computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridllm_cloud.engine.beam_search import BeamGroup
    from hybridllm_cloud.outputs import TokenLogprobs
    from hybridllm_cloud.sampling_params import SamplingParams
    from hybridllm_common.structured import Matcher


class Priority(enum.IntEnum):
    """Scheduling classes: lower value is served first; FIFO within a class."""

    INTERACTIVE = 0
    BATCH = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class KVExport:
    """Prefill role: ship this request's blocks from ``first_block`` on (see disagg)."""

    first_block: int
    sent_upto: int = -1  # blocks before it are final and were shipped; -1: none yet

    def reset(self) -> None:
        """After a preemption the blocks are recomputed (and re-sent) from scratch."""
        self.sent_upto = -1


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    allow_remote_prefill: bool = False  # decode role: the scheduler may ask a prefill worker
    kv_export: KVExport | None = None  # prefill role
    # Speculative decoding: proposals to verify in the next step (set before scheduling,
    # consumed by it) and how many tokens the draft model's cache holds (see spec_decode).
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0
    beam_group: BeamGroup | None = None  # beam search: W beams scheduled as this request
    # Prompt logprobs so far, of positions prompt_logprobs_start.. (a recompute overwrites).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Structured output: where the generated tokens stand in the request's grammar. A
    # preemption keeps the generated tokens, so the matcher stays where it is.
    grammar: Matcher | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def reset_computed(self) -> None:
        """Its blocks are gone (preemption, isolation, failed transfer): recompute all."""
        self.num_computed_tokens = 0
        self.num_draft_computed = 0
        self.spec_token_ids = []

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def sort_key(self) -> tuple[int, float, str]:
        return (int(self.priority), self.arrival_time, self.request_id)
