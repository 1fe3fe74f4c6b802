"""Speculative decoding: proposers, the rejection sampler, rollback, exactness, refusals.

Greedy output with speculation must be the tokens of the same engine without it (the
real SmolLM2-135M-Instruct, n-gram and truncated-layer draft proposers, alone and in a
mixed batch, through the HTTP server once); sampled output must keep the target's
distribution, which is checked statistically on small distributions where the exact
answer is known. Rollback is checked on the block tables after every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from hybridllm_cloud import cli
from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import block_pool, kv_cache_manager, llm_engine, scheduler
from hybridllm_cloud.engine.request import Request
from hybridllm_cloud.model import config as model_config
from hybridllm_cloud.outputs import ModelRunnerOutput
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.server import app as app_mod
from hybridllm_cloud.spec_decode import draft as draft_mod
from hybridllm_cloud.spec_decode import ngram, rejection_sampler
from hybridllm_cloud.spec_decode.config import SpeculativeConfig

from . import random_model

_spec = importlib.util.spec_from_file_location(
    "speculative_bench", Path(__file__).resolve().parents[2] / "bench" / "speculative" / "run.py"
)
assert _spec is not None
assert _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# --- the n-gram proposer -------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_most_recent_longest_match() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 6, 7]
    # suffix [6, 7]: most recent earlier occurrence at 6..7, followed by 3, 4, 9
    assert ngram.propose(tokens, 3, max_n=2, min_n=2) == [3, 4, 9]
    # a longer n-gram wins over a more recent shorter one: the last 2-gram [6, 7] was
    # last followed by [8, 5], the 3-gram [5, 6, 7] (at 5..7) by [3, 4]
    longer = [*tokens, 8, 5, 6, 7]
    assert ngram.propose(longer, 2, max_n=2, min_n=1) == [8, 5]
    assert ngram.propose(longer, 2, max_n=3, min_n=1) == [3, 4]
    # k caps the proposal, and the history's end caps it too
    assert ngram.propose(tokens, 1, max_n=2, min_n=2) == [3]
    assert ngram.propose([1, 2, 1, 2], 5, max_n=2, min_n=1) == [1, 2]


def test_ngram_without_a_match_proposes_nothing() -> None:
    assert ngram.propose([1, 2, 3, 4], 4, max_n=3, min_n=1) == []
    assert ngram.propose([1, 2, 3, 2], 4, max_n=3, min_n=2) == []  # only a 1-gram matches
    assert ngram.propose([1, 2, 3, 2], 4, max_n=3, min_n=1) == [3, 2]
    assert ngram.propose([7], 4, max_n=3, min_n=1) == []  # the suffix never matches itself
    assert ngram.propose([1, 1, 1], 0, max_n=3, min_n=1) == []


# --- the rejection sampler -----------------------------------------------------------------


def _distribution(draws: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(draws), minlength=vocab).double()
    return counts / counts.sum()


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


P = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
Q = torch.tensor([0.30, 0.10, 0.35, 0.05, 0.20])
DRAWS = 20000
# TV distance of DRAWS samples from their own distribution over 5 values is about 0.006
# (sqrt(p(1-p)/n) summed, halved); a sampler off by a real amount is far beyond this.
TV_BOUND = 0.02


def _spec_draws(q: torch.Tensor | None, k: int) -> tuple[list[int], list[int], int]:
    """First and second emitted tokens over DRAWS runs (drafts drawn from q, or a fixed
    one-hot proposal), and how many runs accepted the first proposal."""
    gen = torch.Generator().manual_seed(1234)
    target = torch.stack([P] * (k + 1))
    first, second, accepted = [], [], 0
    for _ in range(DRAWS):
        if q is None:
            drafts, qs = [3] * k, None  # an n-gram proposal: always token 3
        else:
            drafts = [int(torch.multinomial(q, 1, generator=gen)) for _ in range(k)]
            qs = torch.stack([q] * k)
        out = rejection_sampler.rejection_sample(target, drafts, qs, gen)
        first.append(out[0])
        accepted += out[0] == drafts[0] and len(out) > 1
        if len(out) > 1:
            second.append(out[1])
    return first, second, accepted


@pytest.mark.parametrize("q", [Q, None], ids=["draft-q", "one-hot"])
def test_rejection_sampling_keeps_the_target_distribution(q: torch.Tensor | None) -> None:
    first, second, accepted = _spec_draws(q, k=2)
    assert _tv(_distribution(first, 5), P) < TV_BOUND
    # the token after an accepted one is drawn from the next row's p (here the same p)
    assert len(second) > DRAWS // 10
    assert _tv(_distribution(second, 5), P) < 2 * TV_BOUND
    # acceptance is sum(min(p, q)): 0.05+0.1+0.1+0.05+0.15 = 0.45; one-hot on 3: p(3)=0.3
    expected = float(torch.minimum(P, Q).sum()) if q is not None else float(P[3])
    assert abs(accepted / DRAWS - expected) < 0.02


def test_the_exactness_check_can_fail() -> None:
    """Accepting every proposal would emit q's distribution: the bound above rejects it."""
    gen = torch.Generator().manual_seed(5)
    naive = [int(torch.multinomial(Q, 1, generator=gen)) for _ in range(DRAWS)]
    assert _tv(_distribution(naive, 5), P) > 10 * TV_BOUND


def test_verify_greedy_emits_the_argmax_run_and_respects_penalties() -> None:
    vocab = 8
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([3, 4, 6, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    tokens, lps = rejection_sampler.verify(logits, [3, 4, 6], None, greedy, [], None)
    assert tokens == [3, 4, 6, 1]  # all accepted + the bonus token
    assert [lp.top_token_ids for lp in lps if lp is not None] == [[3], [4], [6], [1]]
    tokens, _ = rejection_sampler.verify(logits, [3, 5, 6], None, greedy, [], None)
    assert tokens == [3, 4]  # first mismatch: the target's choice, then the run ends
    # a frequency penalty over output + accepted proposals changes row 1's choice:
    # token 4 was generated 3 times before -> 5 - 3*2.0 < the 2.0 of token 7
    logits[1, 7] = 2.0
    penalized = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    tokens, _ = rejection_sampler.verify(logits, [3, 4, 6], None, penalized, [4, 4, 4], None)
    assert tokens == [3, 7]


# --- the scheduler: token budget, trimming, rollback (no model) -----------------------------


def _scheduler(num_blocks: int = 32, budget: int = 64) -> scheduler.Scheduler:
    kv = kv_cache_manager.KVCacheManager(block_pool.BlockPool(num_blocks), 4)
    return scheduler.Scheduler(
        scheduler.SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64), kv
    )


def _decode_ready(s: scheduler.Scheduler, request: Request) -> None:
    """Admits ``request`` and runs its prefill, sampling token 50."""
    s.add_request(request)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({request.request_id: 50}))


def test_proposals_count_in_the_budget_and_rejected_blocks_are_freed() -> None:
    s = _scheduler(budget=6)
    r = Request("a", list(range(10, 15)), SamplingParams(max_tokens=20), eos_token_ids=(2,))
    _decode_ready(s, r)
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)
    r.spec_token_ids = [60, 61, 62, 63, 64, 65, 66]
    out = s.schedule()
    (rec,) = out.scheduled
    assert rec.token_ids == [50, 60, 61, 62, 63, 64]  # 1 + k, k cut to the budget of 6
    assert rec.spec_token_ids == [60, 61, 62, 63, 64]
    assert out.total_num_scheduled_tokens == 6
    assert len(s.kv.block_ids("a")) == 3  # room for positions up to 10
    assert r.spec_token_ids == []  # consumed
    # the target accepts 60 and emits 70 in place of 61
    (core,) = s.update_from_output(out, ModelRunnerOutput(spec_token_ids={"a": [60, 70]}))
    assert core.new_token_ids == [60, 70]
    assert (r.num_tokens, r.num_computed_tokens) == (8, 7)
    assert len(s.kv.block_ids("a")) == 2  # what 7 computed tokens need, as without proposals
    assert (s.num_spec_drafts, s.num_spec_draft_tokens, s.num_spec_accepted_tokens) == (1, 5, 1)


def test_proposals_stop_short_of_max_tokens_and_eos_ends_an_accepted_run() -> None:
    s = _scheduler()
    r = Request("a", list(range(10, 17)), SamplingParams(max_tokens=3), eos_token_ids=(2,))
    _decode_ready(s, r)  # 1 token out, 2 more allowed: at most 1 proposal
    r.spec_token_ids = [60, 61, 62]
    out = s.schedule()
    assert out.scheduled[0].spec_token_ids == [60]
    s.update_from_output(out, ModelRunnerOutput(spec_token_ids={"a": [60, 61]}))
    assert r.output_token_ids == [50, 60, 61]
    assert r.status.value == "length"
    assert s.kv.pool.num_used_blocks == 0

    r = Request("b", list(range(10, 17)), SamplingParams(max_tokens=10), eos_token_ids=(2,))
    _decode_ready(s, r)
    r.spec_token_ids = [60, 2, 61]
    out = s.schedule()
    (core,) = s.update_from_output(out, ModelRunnerOutput(spec_token_ids={"b": [60, 2, 61, 62]}))
    assert core.new_token_ids == [60, 2]
    assert core.finish_reason == "stop"
    assert r.output_token_ids == [50, 60, 2]
    assert s.kv.pool.num_used_blocks == 0


def test_no_room_for_proposals_decodes_plainly_and_preempts_nobody() -> None:
    s = _scheduler(num_blocks=2)
    r = Request("a", list(range(10, 17)), SamplingParams(max_tokens=20), eos_token_ids=(2,))
    _decode_ready(s, r)  # 7 prompt tokens + 1: both blocks are full after this step
    r.spec_token_ids = [60, 61, 62]
    out = s.schedule()
    assert [x.num_tokens for x in out.scheduled] == [1]
    assert not out.preempted_req_ids
    assert out.scheduled[0].spec_token_ids == []


# --- the real model -------------------------------------------------------------------------

CODE = """def parse_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config: name missing")
    return Config(name=data["name"], size=data.get("size", 1))
"""
TOOL_OUTPUT = (
    "[File: src/config.py (6 lines total)]\n"
    + "".join(f"{i + 1}:{line}\n" for i, line in enumerate(CODE.splitlines()))
    + "(Open file: src/config.py)\n(Current directory: /repo)\nbash-$"
)
CHATS = [
    [{"role": "user", "content": "Repeat this code exactly, then stop:\n" + CODE}],
    [
        {"role": "system", "content": "You are an agent that edits files with tools."},
        {"role": "user", "content": "open src/config.py"},
        {"role": "assistant", "content": "open src/config.py"},
        {
            "role": "user",
            "content": TOOL_OUTPUT + "\nRewrite parse_config with a default size of 2.",
        },
    ],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]
TEXTS = [CODE + "\n" + CODE[:60], "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


def _engine(
    path: Path, spec: SpeculativeConfig | None = None, num_kv_blocks: int = 192
) -> llm_engine.LLMEngine:
    config = llm_engine.EngineConfig(
        num_kv_blocks=num_kv_blocks, max_model_len=1024, speculative=spec or SpeculativeConfig()
    )
    return llm_engine.LLMEngine.from_path(path, config)


@pytest.fixture(scope="module")
def plain(real_model_dir: Path) -> llm_engine.LLMEngine:
    return _engine(real_model_dir)


@pytest.fixture(scope="module")
def prompts(plain: llm_engine.LLMEngine) -> list[list[int]]:
    tok = plain.tokenizer
    assert tok is not None
    return [tok.encode_chat(m) for m in CHATS] + [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def expected(plain: llm_engine.LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in plain.generate(prompts, GREEDY)]


def _check_rollback_each_step(engine: llm_engine.LLMEngine) -> list[llm_engine.RequestOutput]:
    """Runs the engine to completion, checking after every step that each request holds
    exactly the blocks its computed tokens need (nothing left from rejected proposals)."""
    finals = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals.append(out)
        for request in engine.scheduler.running:
            held = len(engine.kv.block_ids(request.request_id))
            assert held == engine.kv.num_blocks_for(request.num_computed_tokens)
    assert engine.stats().num_kv_blocks_used == 0
    return finals


@pytest.mark.slow
def test_ngram_greedy_is_token_identical_alone_and_batched(
    real_model_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    engine = _engine(real_model_dir, SpeculativeConfig("ngram", 4, 4, 1))
    for prompt, want in zip(prompts, expected, strict=True):
        (out,) = engine.generate([prompt], GREEDY)
        assert out.token_ids == want
    # a mixed batch: different lengths and max_tokens, one penalised, one sampled (seeded)
    params = [GREEDY, SamplingParams(max_tokens=7, temperature=0.0), GREEDY, GREEDY, GREEDY]
    params.append(SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    params.append(SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.5))
    batch = [*prompts, prompts[0], prompts[3]]
    for i, p in enumerate(params):
        engine.add_request(f"mix-{i}", batch[i], p)
    finals = {o.request_id: o.token_ids for o in _check_rollback_each_step(engine)}
    assert finals["mix-0"] == expected[0]
    assert finals["mix-1"] == expected[1][:7]
    for i in (2, 3, 4):
        assert finals[f"mix-{i}"] == expected[i]
    (penalized,) = _engine(real_model_dir).generate([prompts[3]], params[6])
    assert finals["mix-6"] == penalized.token_ids
    stats = engine.stats()
    # the code and tool-output prompts repeat themselves: proposals are made and accepted
    assert stats.num_spec_draft_tokens > 0
    assert 0 < stats.num_spec_accepted_tokens <= stats.num_spec_draft_tokens


@pytest.mark.slow
def test_truncated_layer_draft_greedy_is_token_identical(
    real_model_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    layers = _engine(real_model_dir).model.config.num_hidden_layers
    # all layers: the draft is the target, so every proposal must be accepted
    full = _engine(real_model_dir, SpeculativeConfig("draft", 3, draft_num_layers=layers))
    outs = full.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == expected[:2]
    stats = full.stats()
    assert stats.num_spec_draft_tokens > 0
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    # a real (worse) draft: its first layers; rejections roll back, output unchanged
    small = _engine(real_model_dir, SpeculativeConfig("draft", 3, draft_num_layers=12))
    for i, p in enumerate(prompts):
        small.add_request(f"d-{i}", p, GREEDY)
    finals = {o.request_id: o.token_ids for o in _check_rollback_each_step(small)}
    assert [finals[f"d-{i}"] for i in range(len(prompts))] == expected
    stats = small.stats()
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


@pytest.mark.slow
def test_many_rejections_leave_the_blocks_of_a_plain_run(
    real_model_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """A 1-gram proposer guesses wrong most of the time; rollback keeps the cache exact."""
    engine = _engine(real_model_dir, SpeculativeConfig("ngram", 6, 1, 1), num_kv_blocks=96)
    plain = _engine(real_model_dir, num_kv_blocks=96)
    for i, p in enumerate(prompts):
        engine.add_request(f"r-{i}", p, GREEDY)
        plain.add_request(f"r-{i}", p, GREEDY)
    finals = {o.request_id: o.token_ids for o in _check_rollback_each_step(engine)}
    plain_finals = {o.request_id: o.token_ids for o in _check_rollback_each_step(plain)}
    assert finals == plain_finals
    stats = engine.stats()
    assert stats.num_spec_draft_tokens - stats.num_spec_accepted_tokens > 20  # many rejected
    # nothing computed for a rejected proposal was registered in the prefix cache
    assert set(engine.kv.pool.cached_blocks) <= set(plain.kv.pool.cached_blocks)
    assert engine.stats().num_kv_blocks_free == plain.stats().num_kv_blocks_free == 96


@pytest.mark.slow
def test_stop_strings_eos_max_tokens_and_logprobs_inside_accepted_runs(
    real_model_dir: Path, plain: llm_engine.LLMEngine, prompts: list[list[int]]
) -> None:
    engine = _engine(real_model_dir, SpeculativeConfig("ngram", 5, 4, 1))
    prompt = prompts[0]  # repeats the code: long accepted runs
    base = SamplingParams(max_tokens=60, temperature=0.0, logprobs=2)
    (want,) = plain.generate([prompt], base)
    (got,) = engine.generate([prompt], base)
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert engine.stats().num_spec_accepted_tokens > 5
    # stop strings that end inside what a step accepted: cut at the same token and text
    for stop in ("json.load", '"name":', "size="):
        params = SamplingParams(max_tokens=60, temperature=0.0, stop=(stop,))
        (a,) = plain.generate([prompt], params)
        (b,) = engine.generate([prompt], params)
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "stop")
    for n in (1, 2, 9, 17):
        (b,) = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))
        assert b.token_ids == want.token_ids[:n]
        assert b.finish_reason == "length"
    # EOS: the chat answer ends itself within the budget, at the same token
    eos = SamplingParams(max_tokens=120, temperature=0.0)
    (a,) = plain.generate([prompts[2]], eos)
    (b,) = engine.generate([prompts[2]], eos)
    assert a.finish_reason == "stop"
    assert (b.token_ids, b.finish_reason) == (a.token_ids, "stop")
    # logprobs of every emitted token: the model's own, as without speculation
    streamed: list[float] = []
    tops: list[list[int]] = []
    engine.add_request("lp", prompt, base)
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.new_logprobs) == len(out.new_token_ids)
            streamed += [lp.logprob for lp in out.new_logprobs]
            tops += [lp.top_token_ids for lp in out.new_logprobs]
    plain.add_request("lp", prompt, base)
    ref: list[float] = []
    ref_tops: list[list[int]] = []
    while plain.has_unfinished():
        for out in plain.step():
            ref += [lp.logprob for lp in out.new_logprobs]
            ref_tops += [lp.top_token_ids for lp in out.new_logprobs]
    assert tops == ref_tops
    assert torch.allclose(torch.tensor(streamed), torch.tensor(ref), atol=1e-3)


@pytest.mark.slow
def test_seeded_sampling_with_speculation_is_reproducible(
    real_model_dir: Path, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, top_k=50, seed=11)
    runs = []
    for spec in (
        SpeculativeConfig("ngram", 4, 4, 1),
        SpeculativeConfig("draft", 2, draft_num_layers=20),
    ):
        engine = _engine(real_model_dir, spec)
        first = engine.generate([prompts[0], prompts[1]], params)
        again = engine.generate([prompts[0], prompts[1]], params)
        assert [o.token_ids for o in first] == [o.token_ids for o in again]
        runs.append(engine.stats())
    assert all(s.num_spec_draft_tokens > 0 for s in runs)


# --- through the server, with the openai client ----------------------------------------------


@contextlib.contextmanager
def _serve(app: object) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.mark.slow
def test_served_with_ngram_speculation_to_the_openai_client(
    real_model_dir: Path, plain: llm_engine.LLMEngine
) -> None:
    settings = config_mod.ServeSettings(
        model=str(real_model_dir),
        served_model_name="smol",
        speculative_method="ngram",
        num_speculative_tokens=4,
        ngram_prompt_lookup_min=1,
    )
    config = dataclasses.replace(settings.engine_config(), num_kv_blocks=128, max_model_len=1024)
    engine = llm_engine.LLMEngine.from_path(real_model_dir, config)
    with _serve(app_mod.create_app(settings, engine)) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        resp = client.chat.completions.create(
            model="smol",
            messages=CHATS[0],
            max_tokens=40,
            temperature=0,
        )
        assert plain.tokenizer is not None
        (want,) = plain.generate([plain.tokenizer.encode_chat(CHATS[0])], GREEDY)
        assert resp.choices[0].message.content == want.text
        assert resp.usage is not None
        assert resp.usage.completion_tokens == len(want.token_ids)
        chunks = client.chat.completions.create(
            model="smol",
            messages=CHATS[0],
            max_tokens=40,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
        metrics = httpx.get(url + "/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("hybridllm_spec_decode_")
    }
    drafted = values["hybridllm_spec_decode_num_draft_tokens_total"]
    accepted = values["hybridllm_spec_decode_num_accepted_tokens_total"]
    assert values["hybridllm_spec_decode_num_drafts_total"] > 0
    assert 0 < accepted <= drafted


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-speculative-tokens", "3"], "num_speculative_tokens: needs --speculative-method"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "must be >= 1"),
        (
            ["--speculative-method", "ngram", "--ngram-prompt-lookup-max", "2",
             "--ngram-prompt-lookup-min", "3"],
            "ngram_prompt_lookup_max: must be >= ngram_prompt_lookup_min",
        ),
        (
            ["--speculative-method", "ngram", "--speculative-draft-num-layers", "4"],
            "only for --speculative-method draft",
        ),
        (
            ["--speculative-method", "draft", "--ngram-prompt-lookup-max", "4",
             "--speculative-draft-num-layers", "4"],
            "ngram_prompt_lookup_max: only for --speculative-method ngram",
        ),
        (["--speculative-method", "draft"], "draft needs --speculative-draft-model"),
        (
            ["--speculative-method", "ngram", "--role", "prefill"],
            "speculation is for the decode or monolithic role",
        ),
        (["--speculative-draft-model", "/m"], "speculative_draft_model: needs --speculative-method"),
    ],
)  # fmt: skip
def test_invalid_combinations_are_refused_at_start(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_defaults_are_off_and_flags_reach_the_engine() -> None:
    assert config_mod.ServeSettings().engine_config().speculative.enabled is False
    spec = (
        config_mod.ServeSettings(
            speculative_method="ngram", num_speculative_tokens=3, ngram_prompt_lookup_min=1
        )
        .engine_config()
        .speculative
    )
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 4)
    assert spec.prompt_lookup_min == 1
    spec = config_mod.ServeSettings(
        speculative_method="draft", speculative_draft_num_layers=6, role="decode",
        prefill_url="tcp://127.0.0.1:1",
    ).engine_config().speculative  # fmt: skip
    assert (spec.method, spec.draft_num_layers, spec.draft_model) == ("draft", 6, None)


def _tiny_config(vocab: int, layers: int = 2) -> model_config.LlamaConfig:
    return model_config.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip


def test_a_draft_with_another_vocabulary_or_too_many_layers_is_refused() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    target = random_model.random_llama(_tiny_config(100), f32, cpu, 256)
    other = random_model.random_llama(_tiny_config(120), f32, cpu, 256, seed=1)
    config = llm_engine.EngineConfig(
        num_kv_blocks=16,
        block_size=4,
        speculative=SpeculativeConfig("draft", 2, draft_num_layers=1),
    )
    with pytest.raises(ValueError, match="vocabulary of 120 tokens differs from the target's 100"):
        llm_engine.LLMEngine(target, None, config, draft_model=other)
    too_deep = SpeculativeConfig("draft", 2, draft_num_layers=3)
    with pytest.raises(ValueError, match="3 is more than the 2 layers"):
        llm_engine.LLMEngine(
            target, None, llm_engine.EngineConfig(num_kv_blocks=16, speculative=too_deep)
        )


def test_the_draft_cache_is_counted_in_the_kv_budget() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    target = random_model.random_llama(_tiny_config(100, layers=4), f32, cpu, 256)
    budget = 1 << 20
    plain = llm_engine.LLMEngine(
        target, None, llm_engine.EngineConfig(block_size=4, kv_cache_memory_bytes=budget)
    )
    spec = llm_engine.EngineConfig(
        block_size=4,
        kv_cache_memory_bytes=budget,
        speculative=SpeculativeConfig("draft", 2, draft_num_layers=2),
    )
    with_draft = llm_engine.LLMEngine(target, None, spec)
    # 4 target layers + 2 draft layers per block: 2/3 of the blocks in the same memory
    assert with_draft.info.num_kv_blocks == budget // (6 * 2 * 4 * 2 * 8 * 4)
    assert plain.info.num_kv_blocks == budget // (4 * 2 * 4 * 2 * 8 * 4)
    assert isinstance(with_draft.runner.drafter, draft_mod.DraftRunner)
    assert len(with_draft.runner.drafter.kv_caches) == 2


# --- the benchmark harness's pure parts ------------------------------------------------------


def _history(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


def test_bench_prompts_keep_trajectory_and_turn_order() -> None:
    view = "[File: /r/a.py (9 lines total)]\n" + "".join(f"{i}:x = {i}\n" for i in range(1, 10))
    trajectories = [
        ("a.traj", _history(("system", "S" * 50), ("user", "task"), ("assistant", "ls"),
                            ("tool", view), ("assistant", "edit"), ("user", "ok"),
                            ("assistant", "done"))),
        ("b.traj", _history(("system", "T"), ("assistant", "only one call"))),
        ("c.traj", _history(("user", "go"), ("assistant", "one"), ("user", view),
                            ("assistant", "two"))),
    ]  # fmt: skip
    agentic = bench.agentic_chats(trajectories, 5, system_chars=10)
    assert [name for name, _ in agentic] == ["a.traj", "c.traj"]  # b has one call only
    chat = agentic[0][1]
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user"]  # tool -> user
    assert chat[0]["content"] == "S" * 10
    assert chat[-1]["content"] == view
    code = bench.code_chats(trajectories, 5, max_lines=3)
    assert [name for name, _ in code] == ["a.traj"]  # c shows the same file again
    assert "1:x = 1\n2:x = 2\n3:x = 3\n\nWrite" in code[0][1][0]["content"]

    def encode(c: list[dict[str, str]]) -> list[int]:  # one token per character
        return [ord(ch) for m in c for ch in m["content"]]

    turns = _history(("system", "sys"), ("user", "a" * 5), ("assistant", "b" * 5), ("user", "cc"))
    ids = bench.fit(encode, turns, 10)
    assert ids == encode([turns[0], turns[2], turns[3]])  # oldest turn after system dropped
    assert bench.fit(encode, turns[:2], 4) == encode(turns[:2])[-4:]


def test_bench_ratio_and_summary_arithmetic() -> None:
    assert bench.ratio(30.0, 20.0) == 1.5
    assert bench.ratio(1.0, 0.0) == 0.0
    runs = [
        {"tokens": 10, "e2e_s": 2.0, "ttft_s": 0.2, "tpot_s": 0.2},
        {"tokens": 30, "e2e_s": 2.0, "ttft_s": 0.4, "tpot_s": 0.05},
        {"tokens": 20, "e2e_s": 1.0, "ttft_s": 0.3, "tpot_s": 0.04},
    ]
    row = bench.summarise(runs)
    assert row["tokens"] == 60
    assert row["tok_s"] == 12.0
    assert row["tpot_ms"] == pytest.approx(50.0)
    assert row["ttft_ms"] == pytest.approx(300.0)
    assert bench.median_run(runs)["e2e_s"] == 2.0
    timing = bench._timing(0.0, 0.5, 2.5, 5)
    assert timing["tpot_s"] == pytest.approx(0.5)  # 4 tokens after the first in 2 s
