"""Verifier-guided step-level search: a generator proposes steps, a verifier scores them.

The search is one algorithm written as a Python generator that yields batches of model
calls and receives their results, so that the same code runs offline on ``LLMEngine``s
(benchmarks, tests: ``run_offline``) and in the server on the engine threads (``/v1/search``,
``server/serving.py``). Each round:

0. the prompt is computed once (a one-token request), so that the first round's calls
   find it in the prefix cache;
1. every live path asks the generator for ``num_candidates`` continuations of one step
   (sampled, seeded, ending at a step delimiter, an end stop, EOS or ``max_step_tokens``);
   the K requests of a path share its prompt and earlier steps through the prefix cache,
   since those blocks were computed when the previous step was generated;
2. the verifier scores each new, distinct candidate: by default the mean log-likelihood
   of the step under the verifier's context (``verifier_prompt`` with ``{problem}`` and
   ``{steps}``, or the generator's own input), or, with ``verifier_target`` (say ``" Yes"``),
   the log-probability of that answer after the context with the candidate appended. A
   score call is a prompt-logprobs request whose context prefix is cached across rounds;
   when the verifier is the generator itself reading its own context, the logprobs the
   generation computed are the score, and no call is made;
3. paths are ranked by their aggregated step scores (``mean``, ``min`` or ``last``), and the
   best ``beam_width - finished`` continue; a candidate that ended (EOS, an end stop,
   ``max_tokens``) is set aside as finished. The search ends when ``beam_width`` paths have
   finished or after ``max_steps`` rounds (live paths then finish with ``length``).

The ``n`` best finished paths are returned with their steps and scores, and the compute
spent: tokens each model computed (prompt tokens not served by the prefix cache, plus
generated ones), so that other strategies can be compared at equal compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hybridllm_cloud.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridllm_cloud.engine.llm_engine import LLMEngine, RequestOutput
    from hybridllm_cloud.outputs import TokenLogprobs

AGGREGATES = ("mean", "min", "last")
MAX_CANDIDATES = 16
MAX_BEAM_WIDTH = 16


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class StepSearchParams:
    """What a search does; ``validate`` names the offending field (the API answers 400)."""

    num_candidates: int = 4  # K: continuations proposed per live path and round
    beam_width: int = 2  # B: paths kept per round, and paths finished before it ends
    max_steps: int = 16
    max_step_tokens: int = 64
    max_tokens: int = 256  # generated per path, all steps together
    step_delimiters: tuple[str, ...] = ("\n",)
    stop: tuple[str, ...] = ()  # end a path (and are cut from its text)
    temperature: float = 0.8
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1  # finished paths returned, best first
    aggregate: str = "mean"
    verifier_prompt: str | None = None  # with {problem} and {steps}; None: the generator's input
    verifier_target: str | None = None  # None: score the step itself; else P(target | ...)

    def validate(self) -> None:
        if not 1 <= self.num_candidates <= MAX_CANDIDATES:
            raise ValueError(f"num_candidates: must be in [1, {MAX_CANDIDATES}]")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be in [1, {MAX_BEAM_WIDTH}]")
        if not 1 <= self.n <= self.beam_width:
            raise ValueError(f"n: must be in [1, beam_width] (beam_width is {self.beam_width})")
        if self.max_steps < 1:
            raise ValueError("max_steps: must be >= 1")
        if self.max_step_tokens < 1:
            raise ValueError("max_step_tokens: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if not self.step_delimiters or any(not d for d in self.step_delimiters):
            raise ValueError("step_delimiters: at least one non-empty string")
        if any(not s for s in self.stop):
            raise ValueError("stop: empty strings are not allowed")
        if self.temperature <= 0.0:
            raise ValueError(
                "temperature: must be > 0 (the candidates of a path are samples; at 0 they "
                "would all be the same)"
            )
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate: must be one of {', '.join(AGGREGATES)}")
        if self.verifier_prompt is not None and "{steps}" not in self.verifier_prompt:
            raise ValueError("verifier_prompt: must contain {steps} (the path so far)")
        if self.verifier_target is not None and not self.verifier_target:
            raise ValueError("verifier_target: must not be empty")
        self.candidate_params(self.max_step_tokens, 0).validate()

    def candidate_params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """One step's sampling: it ends at an end stop or a step delimiter (end stops
        first, so that where both match at one place the path ends)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop=tuple(dict.fromkeys([*self.stop, *self.step_delimiters])),
        )


@dataclass
class Generate:
    """A generator call: one sampled step."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Score:
    """A verifier call: the logprobs of ``prompt_token_ids[start:]`` given what precedes."""

    prompt_token_ids: list[int]
    start: int

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=self.start
        )


@dataclass
class SearchPath:
    token_ids: list[int] = field(default_factory=list)  # generated, every step
    steps: list[str] = field(default_factory=list)
    step_lens: list[int] = field(default_factory=list)  # tokens of each step
    step_scores: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def score(self, aggregate: str) -> float:
        if not self.step_scores:
            return -math.inf
        if aggregate == "min":
            return min(self.step_scores)
        if aggregate == "last":
            return self.step_scores[-1]
        return sum(self.step_scores) / len(self.step_scores)


@dataclass
class Compute:
    """Tokens computed by each model: uncached prompt tokens plus generated tokens."""

    generator_tokens: int = 0
    verifier_tokens: int = 0
    generated_tokens: int = 0  # of generator_tokens, sampled
    generator_calls: int = 0
    verifier_calls: int = 0

    @property
    def total_tokens(self) -> int:
        return self.generator_tokens + self.verifier_tokens


@dataclass
class SearchResult:
    paths: list[SearchPath]  # the n best finished paths, best first
    texts: list[str]  # their text, end stops cut
    scores: list[float]
    compute: Compute
    num_rounds: int


def computed_tokens(out: RequestOutput) -> int:
    """What a finished request cost its model: prompt tokens it computed, and generated."""
    return out.num_prompt_tokens - out.num_cached_tokens + len(out.token_ids)


@dataclass
class Problem:
    """The search's input: the generator's prompt, and the text the verifier sees."""

    token_ids: list[int]
    text: str  # the generator's input as text (a rendered chat template for messages)
    problem: str  # what {problem} stands for in verifier_prompt
    chat: bool = False  # ``text`` holds special tokens (encode without adding more)


def search(
    problem: Problem,
    params: StepSearchParams,
    tokenizer: TextTokenizer,
    verifier_tokenizer: TextTokenizer | None = None,
    separate_verifier: bool = False,
) -> Generator[list[Generate] | list[Score], list[RequestOutput], SearchResult]:
    """The search. ``verifier_tokenizer`` None: the verifier reads the generator's token
    ids, so without a ``verifier_prompt`` a step is scored on the generator's own tokens;
    and when the verifier is the generator itself (``separate_verifier`` false) with
    neither ``verifier_prompt`` nor ``verifier_target``, a step's score is the logprobs
    its generation already computed: no verifier call at all."""
    params.validate()
    own_scores = (
        not separate_verifier
        and verifier_tokenizer is None
        and params.verifier_prompt is None
        and params.verifier_target is None
    )
    live = [SearchPath()]
    done: list[SearchPath] = []
    compute = Compute()
    if params.num_candidates > 1:
        # The first round's K calls share the whole prompt, but requests admitted in one
        # step do not share blocks they are all still computing: one call computes it first.
        (warm,) = yield [Generate(problem.token_ids, SamplingParams(max_tokens=1, temperature=0.0))]
        compute.generator_calls += 1
        compute.generator_tokens += computed_tokens(warm)
        compute.generated_tokens += len(warm.token_ids)
    rounds = 0
    for step in range(params.max_steps):
        rounds += 1
        calls: list[Generate] = []
        owners: list[SearchPath] = []
        for p_idx, path in enumerate(live):
            room = min(params.max_step_tokens, params.max_tokens - len(path.token_ids))
            for k in range(params.num_candidates):
                seed = None
                if params.seed is not None:
                    seed = params.seed + (step * MAX_BEAM_WIDTH + p_idx) * MAX_CANDIDATES + k
                cparams = params.candidate_params(room, seed)
                if own_scores:
                    cparams = dataclasses.replace(cparams, logprobs=0)
                calls.append(Generate(problem.token_ids + path.token_ids, cparams))
                owners.append(path)
        outs = yield calls
        compute.generator_calls += len(calls)
        candidates: list[SearchPath] = []
        seen: set[tuple[int, ...]] = set()
        for path, out in zip(owners, outs, strict=True):
            compute.generator_tokens += computed_tokens(out)
            compute.generated_tokens += len(out.token_ids)
            ids = path.token_ids + list(out.token_ids)
            if tuple(ids) in seen:  # a duplicate sample would take a second beam slot
                continue
            seen.add(tuple(ids))
            step_text = tokenizer.decode(list(out.token_ids))
            finish, reason = _ended(out, params, len(ids))
            spanning = _spanning_stop(path.steps, step_text, params.stop)
            if spanning is not None:  # an end stop across steps ("\n" then "\n")
                finish, reason = "stop", spanning
            cand = SearchPath(
                ids,
                [*path.steps, step_text],
                [*path.step_lens, len(out.token_ids)],
                list(path.step_scores),
                finish,
                reason,
            )
            if own_scores:
                cand.step_scores.append(_mean(out.logprobs or []))
            candidates.append(cand)
        if not own_scores:
            scores = yield [
                _score_call(problem, c, params, verifier_tokenizer, tokenizer) for c in candidates
            ]
            compute.verifier_calls += len(candidates)
            for cand, out in zip(candidates, scores, strict=True):
                compute.verifier_tokens += out.num_prompt_tokens - out.num_cached_tokens
                cand.step_scores.append(_mean(out.prompt_logprobs or []))
        candidates.sort(key=lambda c: c.score(params.aggregate), reverse=True)
        live = []
        for cand in candidates[: params.beam_width - len(done)]:
            (done if cand.finish_reason is not None else live).append(cand)
        if not live:
            break
    for path in live:
        path.finish_reason = "length"
    done.extend(live)
    done.sort(key=lambda c: c.score(params.aggregate), reverse=True)
    best = done[: params.n]
    return SearchResult(
        paths=best,
        texts=[_text(p, tokenizer, params) for p in best],
        scores=[p.score(params.aggregate) for p in best],
        compute=compute,
        num_rounds=rounds,
    )


def _mean(lps: list[TokenLogprobs]) -> float:
    return sum(lp.logprob for lp in lps) / max(len(lps), 1)


def _ended(
    out: RequestOutput, params: StepSearchParams, num_tokens: int
) -> tuple[str | None, str | int | None]:
    """Whether a candidate ends its path: an end stop or EOS ("stop"), or ``max_tokens``."""
    if out.finish_reason == "stop":
        if isinstance(out.stop_reason, str) and out.stop_reason not in params.stop:
            return (None, None) if num_tokens < params.max_tokens else ("length", None)
        return "stop", out.stop_reason
    if num_tokens >= params.max_tokens:
        return "length", None
    return None, None  # the step reached max_step_tokens: the path goes on


def _spanning_stop(steps: list[str], step: str, stops: tuple[str, ...]) -> str | None:
    """An end stop that begins in an earlier step and ends in this one."""
    before = "".join(steps)
    for stop in stops:
        tail = before[-(len(stop) - 1) :] if len(stop) > 1 else ""
        if tail and stop in tail + step[: len(stop) - 1]:
            return stop
    return None


def _text(path: SearchPath, tokenizer: TextTokenizer, params: StepSearchParams) -> str:
    text = "".join(path.steps)
    if isinstance(path.stop_reason, str) and path.stop_reason in params.stop:
        idx = text.find(path.stop_reason)
        if idx >= 0:
            text = text[:idx]
    return text


def _score_call(
    problem: Problem,
    cand: SearchPath,
    params: StepSearchParams,
    verifier_tokenizer: TextTokenizer | None,
    tokenizer: TextTokenizer | None = None,
) -> Score:
    """The verifier's call for a candidate (``verifier_tokenizer`` None: the generator's)."""
    if verifier_tokenizer is None and params.verifier_prompt is None:
        # The generator's own tokens: everything before the step is in its prefix cache.
        ids = problem.token_ids + cand.token_ids
        if params.verifier_target is None:
            return Score(ids, len(ids) - cand.step_lens[-1])
        assert tokenizer is not None
        target = tokenizer.encode(params.verifier_target, add_special_tokens=False)
        return Score(ids + target, len(ids))
    vtok = verifier_tokenizer or tokenizer
    assert vtok is not None
    before = "".join(cand.steps[:-1])
    if params.verifier_target is None:
        context, scored = _context(problem, params, before), cand.steps[-1]
    else:
        context, scored = _context(problem, params, before + cand.steps[-1]), params.verifier_target
    special = not problem.chat or params.verifier_prompt is not None
    head = vtok.encode(context, add_special_tokens=special)
    ids = vtok.encode(context + scored, add_special_tokens=special)
    start = next((i for i, (a, b) in enumerate(zip(head, ids, strict=False)) if a != b), len(head))
    return Score(ids, max(1, min(start, len(ids) - 1)))


def _context(problem: Problem, params: StepSearchParams, steps: str) -> str:
    if params.verifier_prompt is None:
        return problem.text + steps
    return params.verifier_prompt.replace("{problem}", problem.problem).replace("{steps}", steps)


def run_offline(
    problem: Problem,
    params: StepSearchParams,
    generator: LLMEngine,
    verifier: LLMEngine | None = None,
) -> SearchResult:
    """Runs a search to its end on engines in this thread (``verifier`` None: the generator
    scores its own steps, in the same engine and KV cache)."""
    return run_offline_batch([problem], [params], generator, verifier)[0]


def run_offline_batch(
    problems: list[Problem],
    params: list[StepSearchParams],
    generator: LLMEngine,
    verifier: LLMEngine | None = None,
) -> list[SearchResult]:
    """Runs several searches side by side, as concurrent requests to a server would: each
    round, the calls every search is waiting for run as one batch per engine."""
    assert generator.tokenizer is not None
    vtok = verifier.tokenizer if verifier is not None else None
    runs = [
        search(problem, p, generator.tokenizer, vtok, verifier is not None)
        for problem, p in zip(problems, params, strict=True)
    ]
    pending: dict[int, list[Generate] | list[Score]] = {i: next(run) for i, run in enumerate(runs)}
    results: dict[int, SearchResult] = {}
    while pending:
        by_engine: dict[int, list[tuple[int, Generate | Score]]] = {}
        for i, calls in pending.items():
            on_verifier = verifier is not None and bool(calls) and isinstance(calls[0], Score)
            by_engine.setdefault(int(on_verifier), []).extend((i, c) for c in calls)
        outs: dict[int, list[RequestOutput]] = {i: [] for i in pending}
        for which, items in by_engine.items():
            engine = verifier if which and verifier is not None else generator
            done = engine.generate(
                [c.prompt_token_ids for _, c in items], [c.params for _, c in items]
            )
            for (i, _), out in zip(items, done, strict=True):
                outs[i].append(out)
        for i in list(pending):
            try:
                pending[i] = runs[i].send(outs[i])
            except StopIteration as stop:
                results[i] = stop.value
                del pending[i]
    return [results[i] for i in range(len(runs))]
