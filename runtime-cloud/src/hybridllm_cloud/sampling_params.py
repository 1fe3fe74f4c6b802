"""What a request asks of generation: length, sampling, stops, logprobs, beams, a grammar.

Frozen and plain, so it crosses every seam as is: the server builds it, the scheduler
keeps it on the request, and the model runner, the sampler and the rejection sampler read
it from each ``ScheduledRequest``. It sits below the engine and the worker for that reason
(as vLLM's ``vllm/sampling_params.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridllm_common.structured import Constraint


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
