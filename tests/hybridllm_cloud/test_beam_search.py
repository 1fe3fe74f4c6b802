"""Beam search and n/best_of: HF identity, shared KV, preemption of a beam group, the API.

Beam search must return exactly what HF transformers' ``generate(num_beams=W,
do_sample=False, ...)`` returns, in HF's order, on the real SmolLM2-135M-Instruct and on the
tiny random model; the beams of a request must hold far fewer KV blocks than one table per
beam and give every block back; a beam group preempted mid-search must resume to the same
result; the OpenAI server must serve it through the real ``openai`` client and refuse, by
name, what it cannot honour.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.engine.request import RequestStatus
from hybridllm_cloud.outputs import SchedulerOutput
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.server import app as app_mod
from hybridllm_common import admission
from hybridllm_common import openai_protocol as oai

from .test_server import serve

QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number.",
    "Write a haiku about the sea.",
]
TINY_TEXTS = [
    "The quick brown fox",
    "Hello world! How are you today? I am fine",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching admits",
]


def beam_params(
    width: int,
    n: int = 1,
    max_tokens: int = 16,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        use_beam_search=True,
        beam_width=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=n,
    )


def hf_beams(
    model: torch.nn.Module, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]
) -> list[list[int]]:
    """HF's returned sequences, generated part only, each cut after its first EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            num_beams=params.beam_width,
            do_sample=False,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            max_new_tokens=params.max_tokens,
            num_return_sequences=params.num_return_sequences,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    seqs: list[list[int]] = []
    for row in out.tolist():
        cut: list[int] = []
        for token in row[len(prompt) :]:
            cut.append(token)
            if token in eos:
                break
        seqs.append(cut)
    return seqs


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_engine(path: Path, **kw: object) -> llm_engine.LLMEngine:
    return llm_engine.LLMEngine.from_path(path, llm_engine.EngineConfig(**kw))


def run_one(
    engine: llm_engine.LLMEngine, prompt: list[int], params: SamplingParams
) -> list[list[int]]:
    (out,) = engine.generate([prompt], params)
    assert out.sequences is not None
    return [s.token_ids for s in out.sequences]


def assert_no_block_held(engine: llm_engine.LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_used_blocks == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- HF identity --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(real_model_dir: Path) -> tuple[llm_engine.LLMEngine, torch.nn.Module, list[list[int]]]:
    engine = make_engine(real_model_dir, num_kv_blocks=256, block_size=16, max_model_len=1024)
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return engine, load_hf(real_model_dir), prompts


@pytest.mark.slow
@pytest.mark.parametrize(
    ("width", "n", "length_penalty", "early_stopping"),
    [(2, 2, 1.0, False), (4, 4, 0.5, True), (3, 1, 2.0, "never")],
)
def test_real_model_beams_match_hf(
    real: tuple[llm_engine.LLMEngine, torch.nn.Module, list[list[int]]],
    width: int,
    n: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> None:
    engine, hf, prompts = real
    params = beam_params(width, n, 20, length_penalty, early_stopping)
    for prompt in prompts:
        ours = run_one(engine, prompt, params)
        assert ours == hf_beams(hf, prompt, params, engine.info.eos_token_ids)
        assert len(ours) == n
    assert_no_block_held(engine)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[torch.nn.Module, list[list[int]], tuple[int, ...]]:
    engine = make_engine(tiny_model_dir, num_kv_blocks=64, block_size=4)
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(t) for t in TINY_TEXTS]
    return load_hf(tiny_model_dir), prompts, engine.info.eos_token_ids


@pytest.mark.parametrize("width", [2, 4, 8])
def test_tiny_model_beams_match_hf_with_several_requests_in_one_batch(
    tiny_model_dir: Path,
    tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]],
    width: int,
) -> None:
    """Beam groups batched with each other and with a greedy request, small blocks."""
    hf, prompts, eos = tiny
    engine = make_engine(tiny_model_dir, num_kv_blocks=256, block_size=4)
    params = [beam_params(width, n=min(width, 3), max_tokens=12) for _ in prompts]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate([*prompts, prompts[0]], [*params, greedy])
    for prompt, p, out in zip(prompts, params, outs, strict=False):
        assert out.sequences is not None
        assert [s.token_ids for s in out.sequences] == hf_beams(hf, prompt, p, eos)
    alone = make_engine(tiny_model_dir, num_kv_blocks=64, block_size=4)
    assert outs[-1].token_ids == alone.generate([prompts[0]], greedy)[0].token_ids
    assert outs[-1].sequences is None
    assert_no_block_held(engine)


# --- KV sharing -----------------------------------------------------------------------------


def peak_blocks(
    engine: llm_engine.LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[int, llm_engine.RequestOutput]:
    """Runs one request alone; the most blocks the pool had in use during any step.

    Measured right after scheduling, while the step's blocks are all held (after the step,
    beams that were not chosen have already given theirs back).
    """
    schedule, pool, peak = engine.scheduler.schedule, engine.kv.pool, [0]

    def measured() -> SchedulerOutput:
        out = schedule()
        peak[0] = max(peak[0], pool.num_used_blocks)
        return out

    engine.scheduler.schedule = measured  # type: ignore[method-assign]
    engine.add_request("r", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert final is not None
    assert final.finished
    return peak[0], final


def test_beams_share_blocks_and_give_every_block_back(
    tiny_model_dir: Path, tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]]
) -> None:
    _, prompts, _ = tiny
    prompt = prompts[2] * 2  # a longer prompt: sharing it is most of the saving
    width, max_tokens = 8, 16
    params = beam_params(width, n=2, max_tokens=max_tokens)
    single = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    engine = make_engine(
        tiny_model_dir, num_kv_blocks=512, block_size=4, enable_prefix_caching=False
    )
    one_seq, _ = peak_blocks(engine, prompt, single)
    shared, out = peak_blocks(engine, prompt, params)
    assert_no_block_held(engine)

    copying = make_engine(
        tiny_model_dir, num_kv_blocks=512, block_size=4, enable_prefix_caching=False
    )
    copying._beam_share_kv = False  # the copy-per-beam baseline
    copied, out_copied = peak_blocks(copying, prompt, params)
    assert_no_block_held(copying)

    assert out.sequences is not None
    assert out_copied.sequences is not None
    assert [s.token_ids for s in out.sequences] == [s.token_ids for s in out_copied.sequences]
    assert one_seq == -(-(len(prompt) + max_tokens) // 4)
    assert shared < 0.4 * width * one_seq, (shared, one_seq)
    assert copied >= width * (len(prompt) // 4)  # every beam held its own prompt copy
    assert shared < 0.5 * copied
    # what the request reports: distinct blocks against one table per beam
    assert out.beam_kv is not None
    assert out.beam_kv.peak_blocks <= shared
    assert out.beam_kv.peak_blocks < 0.4 * out.beam_kv.peak_blocks_copy_per_beam
    assert out.beam_kv.num_block_copies > 0  # the beams did diverge inside a block


def test_an_aborted_beam_group_frees_its_blocks(
    tiny_model_dir: Path, tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]]
) -> None:
    _, prompts, _ = tiny
    engine = make_engine(tiny_model_dir, num_kv_blocks=128, block_size=4)
    engine.add_request("b", prompts[1], beam_params(4, max_tokens=32))
    for _ in range(5):
        assert not any(o.finished for o in engine.step())
    group = engine.scheduler.requests["b"].beam_group
    assert group is not None
    assert group.tables is not None
    assert len(group.tables) == 4
    assert engine.kv.pool.num_used_blocks > 0
    engine.abort(["b"])
    assert_no_block_held(engine)


# --- preemption ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [512, 6])
def test_a_preempted_beam_group_resumes_to_the_same_result(
    tiny_model_dir: Path,
    tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]],
    budget: int,
) -> None:
    """A greedy request that arrived first grows until the beam group (last) is preempted.

    The group resumes once the other finishes: its prompt and common prefix as one trunk,
    then each beam's own tokens; with a budget of 6 tokens in chunks.
    """
    hf, prompts, eos = tiny
    params = beam_params(4, n=2, max_tokens=24)
    long = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    engine = make_engine(
        tiny_model_dir, num_kv_blocks=40, block_size=4, max_num_batched_tokens=budget
    )
    first = prompts[2] * 3  # 27 blocks of prompt, 39 at the end: room for the group early on
    engine.add_request("first", first, long)
    engine.add_request("beams", prompts[0], params)
    preempted_with_beams = 0
    finals: dict[str, llm_engine.RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        request = engine.scheduler.requests.get("beams")
        if (
            request is not None
            and request.status == RequestStatus.PREEMPTED
            and request.beam_group is not None
            and request.beam_group.has_beams
        ):
            preempted_with_beams += 1
    assert preempted_with_beams > 0  # preempted mid-search, not before it began
    assert finals["beams"].sequences is not None
    got = [s.token_ids for s in finals["beams"].sequences]
    assert got == hf_beams(hf, prompts[0], params, eos)
    roomy = make_engine(tiny_model_dir, num_kv_blocks=256, block_size=4)
    assert finals["first"].token_ids == roomy.generate([first], long)[0].token_ids
    assert_no_block_held(engine)


def test_a_search_that_could_not_resume_in_the_cache_is_refused(tiny_model_dir: Path) -> None:
    """W unshared full-length tables must fit, or a preempted group could never come back."""
    engine = make_engine(tiny_model_dir, num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="best_of: 4 beams of up to 27 tokens may need 28"):
        engine.add_request("b", list(range(3, 10)), beam_params(4, max_tokens=20))
    engine.add_request("ok", list(range(3, 10)), beam_params(2, max_tokens=20))


# --- the OpenAI server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[tuple[str, llm_engine.LLMEngine]]:
    settings = config_mod.ServeSettings(
        model=str(tiny_model_dir), served_model_name="tiny", max_waiting_requests=64
    )
    engine = make_engine(tiny_model_dir, num_kv_blocks=256, block_size=4, max_model_len=256)
    app = app_mod.create_app(settings, engine)
    with serve(app) as url:
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        yield url, engine


@pytest.fixture
def client(server: tuple[str, llm_engine.LLMEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_completions_beam_search_through_the_openai_client(
    server: tuple[str, llm_engine.LLMEngine],
    client: openai.OpenAI,
    tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]],
) -> None:
    hf, _, eos = tiny
    _, engine = server
    assert engine.tokenizer is not None
    text = TINY_TEXTS[1]
    resp = client.completions.create(
        model="tiny", prompt=text, max_tokens=12, n=2,
        extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.8,
                    "early_stopping": True},
    )  # fmt: skip
    params = beam_params(4, n=2, max_tokens=12, length_penalty=0.8, early_stopping=True)
    want = hf_beams(hf, engine.tokenizer.encode(text), params, eos)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [engine.tokenizer.decode(w) for w in want]
    assert len({c.text for c in resp.choices}) == 2
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(len(w) for w in want)
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode(text))


def test_chat_beam_search_through_the_openai_client(
    server: tuple[str, llm_engine.LLMEngine],
    client: openai.OpenAI,
    tiny: tuple[torch.nn.Module, list[list[int]], tuple[int, ...]],
) -> None:
    hf, _, eos = tiny
    _, engine = server
    assert engine.tokenizer is not None
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, n=3, temperature=0,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    params = beam_params(3, n=3, max_tokens=10)
    want = hf_beams(hf, engine.tokenizer.encode_chat(messages), params, eos)
    assert [c.message.content for c in resp.choices] == [engine.tokenizer.decode(w) for w in want]
    assert [c.finish_reason for c in resp.choices] == [
        "stop" if w[-1] in eos else "length" for w in want
    ]
    assert resp.usage is not None
    assert resp.usage.completion_tokens == sum(len(w) for w in want)


def test_n_and_best_of_are_reproducible_with_a_seed(client: openai.OpenAI) -> None:
    def ask(**kw: object) -> openai.types.Completion:
        return client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=1.0,
            seed=11, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    first, again = ask(n=3), ask(n=3)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) == 3  # seed, seed + 1, seed + 2: distinct
    # best_of=4, n=2: the two of the four candidates (seeds 11..14) with the highest mean
    # token logprob, best first; the same candidates that n=4 returns in seed order
    all_four = ask(n=4, logprobs=0)
    best = ask(n=2, logprobs=0, extra_body={"best_of": 4})
    assert [c.text for c in best.choices] == [
        c.text for c in ask(n=2, extra_body={"best_of": 4}).choices
    ]

    def mean(c: openai.types.CompletionChoice) -> float:
        assert c.logprobs is not None
        assert c.logprobs.token_logprobs
        lps = [x for x in c.logprobs.token_logprobs if x is not None]
        return sum(lps) / len(lps)

    ranked = sorted(all_four.choices, key=lambda c: -mean(c))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert best.usage is not None
    assert best.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in best.choices if c.logprobs is not None
    )


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"stream": True, "extra_body": {"use_beam_search": True}}, "stream"),
        ({"temperature": 0.7, "extra_body": {"use_beam_search": True}}, "temperature"),
        ({"top_p": 0.5, "extra_body": {"use_beam_search": True}}, "top_p"),
        ({"logprobs": 1, "extra_body": {"use_beam_search": True}}, "logprobs"),
        ({"stop": ["x"], "extra_body": {"use_beam_search": True}}, "stop"),
        ({"n": 3, "extra_body": {"use_beam_search": True, "best_of": 2}}, "best_of"),
        ({"extra_body": {"use_beam_search": True, "early_stopping": "soon"}}, "early_stopping"),
        ({"extra_body": {"use_beam_search": "yes"}}, "use_beam_search"),
        ({"extra_body": {"length_penalty": 0.5}}, "length_penalty"),
        ({"extra_body": {"early_stopping": True}}, "early_stopping"),
        ({"stream": True, "n": 1, "extra_body": {"best_of": 3}}, "best_of"),
        ({"extra_body": {"best_of": 64}}, "best_of"),
    ],
)
def test_combinations_beam_search_cannot_honour_are_refused_by_name(
    server: tuple[str, llm_engine.LLMEngine],
    client: openai.OpenAI,
    kw: dict[str, object],
    param: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, **kw)  # type: ignore[call-overload]
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert f"- {param}: " in caught.value.message  # "Error code: 400 - NAME: why"
    assert_no_block_held(server[1])


def test_the_edge_runtime_still_refuses_beam_search() -> None:
    """The shared admission refuses the beam parameters unless a runtime says it has them."""
    body = oai.CompletionRequest.model_validate(
        {"prompt": "x", "use_beam_search": True, "length_penalty": 0.5}
    )
    with pytest.raises(oai.APIError, match="use_beam_search: not supported yet"):
        admission.refuse_unsupported(body)
    admission.refuse_unsupported(body, frozenset({"use_beam_search", "length_penalty"}))
