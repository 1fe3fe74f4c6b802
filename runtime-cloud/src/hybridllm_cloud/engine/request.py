"""A request as the engine sees it: token ids, sampling parameters and progress.

The scheduler owns request objects; the model runner never sees them (it receives plain
``ScheduledRequest`` records). ``num_computed_tokens`` counts tokens whose K/V are in the
cache; preemption by recompute resets it to 0 and keeps the generated tokens, which are
then recomputed as if they were part of the prompt.

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
    from hybridllm_cloud.engine.outputs import TokenLogprobs
    from hybridllm_common.structured import Constraint, Matcher


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


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob + top k
    cache_salt: str = ""  # prefix-cache partition: blocks are shared only within one salt
    presence_penalty: float = 0.0  # OpenAI's: over the tokens generated so far
    frequency_penalty: float = 0.0
    # Beam search (engine/beam_search.py), HF generate's num_beams / length_penalty /
    # early_stopping (True, False or "never") / num_return_sequences.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    # Prompt logprobs (vLLM's ``prompt_logprobs``): the logprob of each prompt token from
    # position ``prompt_logprobs_start`` on, plus its top k. Positions before it may come
    # from the prefix cache; those from ``start - 1`` on are computed (their logits are
    # needed), so a scorer that keeps a fixed context and varies the tail pays for the tail.
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    # Structured output / tool calls: the grammar every sampled token must keep to
    # (hybridllm_common.structured); each request gets its own matcher of it.
    constraint: Constraint | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises ValueError naming the parameter (the server maps it to a 400)."""
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if self.temperature < 0.0:
            raise ValueError("temperature: must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p: must be in (0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs: must be in [0, 20]")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= 20:
                raise ValueError("prompt_logprobs: must be in [0, 20]")
            if self.prompt_logprobs_start < 1:
                raise ValueError("prompt_logprobs_start: must be >= 1 (the first token has none)")
            if self.use_beam_search:
                raise ValueError("prompt_logprobs: not supported with beam search yet")
        if self.use_beam_search:
            if self.constraint is not None:
                raise ValueError(
                    f"{self.constraint.param}: structured output is not supported with beam search"
                )
            self._validate_beams()

    def _validate_beams(self) -> None:
        """Beam search keeps what HF's deterministic beam search has; the rest is refused."""
        if not 1 <= self.beam_width <= 64:
            raise ValueError("best_of: the beam width must be in [1, 64]")
        if not 1 <= self.num_return_sequences <= self.beam_width:
            raise ValueError("n: must be in [1, beam width (best_of)]")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError('early_stopping: must be true, false or "never"')
        if self.stop:
            raise ValueError("stop: stop strings are not supported with beam search yet")
        if self.logprobs is not None:
            raise ValueError("logprobs: not supported with beam search yet")
        if self.penalized:
            raise ValueError("presence_penalty: penalties are not supported with beam search")


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
