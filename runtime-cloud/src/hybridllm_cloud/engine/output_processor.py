"""Output processing: a step's ``EngineCoreOutput``s made ``RequestOutput``s (vLLM v1's
``OutputProcessor``).

Each request's tokens are detokenised incrementally. Stop strings are matched here, on
the detokenised text, and end the request through the scheduler like an abort (the
engine's ``stop_request`` callback); while a request runs, the last
``len(longest stop) - 1`` characters are held back so a stream never shows the beginning
of a stop string. A finished beam search is detokenised whole, one ``SequenceOutput`` per
returned sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridllm_cloud import tokenizer as tokenizer_mod
from hybridllm_cloud.outputs import BeamKVStats, EngineCoreOutput, TokenLogprobs
from hybridllm_cloud.sampling_params import SamplingParams


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


class OutputProcessor:
    """The output state of every unfinished request; ``stop_request(request_id)`` ends a
    request in the scheduler when its text has reached a stop string."""

    def __init__(
        self, tokenizer: tokenizer_mod.Tokenizer | None, stop_request: Callable[[str], None]
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_request = stop_request
        self.states: dict[str, _OutputState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = tokenizer_mod.IncrementalDetokenizer(
                self.tokenizer, prompt_tail=list(prompt_token_ids[-5:])
            )
        self.states[request_id] = _OutputState(
            detok,
            params.stop,
            len(prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
        )

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The outputs of a step's requests (none for a request aborted meanwhile)."""
        outputs: list[RequestOutput] = []
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            if core.beams is not None:
                del self.states[core.request_id]
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
                            self.stop_request(core.request_id)
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
                del self.states[core.request_id]
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
