"""Verifier-guided step search: prompt logprobs in the engine, the search, and /v1/search.

Prompt logprobs are checked against HF transformers' log-softmax on the real
SmolLM2-135M-Instruct (whole prompt, behind a cached prefix, across prefill chunks, after
a preemption). The search's selection is checked by driving its generator with scripted
outputs (which paths continue, which finish, what is returned); its scores on the real
model against HF's likelihood of each step; the HTTP endpoint through the openai client
with the model verifying itself and with a separate truncated-layer verifier.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from hybridllm_cloud import config as config_mod
from hybridllm_cloud.engine import llm_engine
from hybridllm_cloud.outputs import TokenLogprobs
from hybridllm_cloud.sampling_params import SamplingParams
from hybridllm_cloud.search import step_search
from hybridllm_cloud.search import verifier as verifier_mod
from hybridllm_cloud.server import app as app_mod
from hybridllm_cloud.spec_decode import draft as draft_mod

from .test_server import serve

SHOTS = (
    "Q: 3 + 4 - 2 = ?\nA: 3 + 4 = 7\n7 - 2 = 5\nAnswer: 5\n\n"
    "Q: 6 + 2 - 1 = ?\nA: 6 + 2 = 8\n8 - 1 = 7\nAnswer: 7\n\n"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def real(real_model_dir: Path) -> tuple[llm_engine.LLMEngine, Any]:
    from transformers import AutoModelForCausalLM

    engine = llm_engine.LLMEngine.from_path(
        real_model_dir,
        llm_engine.EngineConfig(num_kv_blocks=128, block_size=16, max_model_len=1024),
    )
    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    return engine, hf


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1]: HF's logprob of each token after the first, given what precedes."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def prompt_lps(engine: llm_engine.LLMEngine, ids: list[int], start: int, k: int = 0) -> Any:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k,
                            prompt_logprobs_start=start)  # fmt: skip
    return engine.generate([ids], params)[0]


# --- prompt logprobs -------------------------------------------------------------------------


def test_prompt_logprobs_are_hfs_whole_and_behind_a_cached_prefix(
    real: tuple[llm_engine.LLMEngine, Any],
) -> None:
    engine, hf = real
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(SHOTS + "Q: 5 + 8 - 3 = ?\nA: 5 + 8 = 13\n13 - 3 = 10\n")
    ref = hf_logprobs(hf, ids)
    out = prompt_lps(engine, ids, 1, k=3)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs])
    assert len(got) == len(ids) - 1
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)
    with torch.no_grad():  # the top 3 of a position are HF's
        logits = hf(torch.tensor([ids])).logits[0, 10]
    assert out.prompt_logprobs[10].top_token_ids == torch.topk(logits, 3).indices.tolist()
    # Again from position 70: the blocks before 69 come from the prefix cache, only the
    # tail is computed, and its values are the same.
    again = prompt_lps(engine, ids, 70)
    assert again.num_cached_tokens == 64  # four 16-token blocks, all before position 69
    tail = torch.tensor([lp.logprob for lp in again.prompt_logprobs])
    torch.testing.assert_close(tail, ref[69:], atol=2e-4, rtol=0)


def test_prompt_logprobs_across_chunks_and_after_a_preemption(
    real_model_dir: Path, real: tuple[llm_engine.LLMEngine, Any]
) -> None:
    engine, hf = real
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(SHOTS * 2)
    ref = hf_logprobs(hf, ids)
    chunked = llm_engine.LLMEngine(
        engine.model,
        engine.tokenizer,
        llm_engine.EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=24,
                                enable_prefix_caching=False),
    )  # fmt: skip
    request_id = "chunked"
    chunked.add_request(request_id, ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                        prompt_logprobs=0))  # fmt: skip
    chunked.step()
    chunked.step()  # 48 of the prompt's tokens computed, with their logprobs
    request = chunked.scheduler.requests[request_id]
    assert 0 < len(request.prompt_logprobs) < len(ids) - 1
    # preempted by recompute: the computed chunks are computed (and stored) again
    chunked.scheduler._preempt_last()
    assert request.num_computed_tokens == 0
    final = None
    while chunked.has_unfinished():
        for out in chunked.step():
            final = out
    assert final is not None
    got = torch.tensor([lp.logprob for lp in final.prompt_logprobs])
    assert len(got) == len(ids) - 1
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


def test_prompt_logprobs_refusals(real: tuple[llm_engine.LLMEngine, Any]) -> None:
    engine, _ = real
    with pytest.raises(ValueError, match="prompt_logprobs: must be in"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs_start: must be >= 1"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=0).validate()
    with pytest.raises(ValueError, match="prompt_logprobs: not supported with beam search"):
        SamplingParams(prompt_logprobs=0, use_beam_search=True, beam_width=2,
                       temperature=0.0).validate()  # fmt: skip
    with pytest.raises(ValueError, match="prompt_logprobs_start: 5 is not a position"):
        engine.add_request("x", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0,
                                                                prompt_logprobs_start=5))  # fmt: skip
    assert not engine.has_unfinished()


# --- the search, driven by scripted outputs --------------------------------------------------


class Words:
    """A tokenizer of one character per token: ids are code points."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def gen_out(text: str, finish: str = "stop", stop_reason: Any = "\n",
            prompt: int = 10, cached: int = 0) -> llm_engine.RequestOutput:  # fmt: skip
    ids = [ord(c) for c in text]
    return llm_engine.RequestOutput("g", ids, text, ids, text, True, finish, stop_reason,
                                    num_prompt_tokens=prompt, num_cached_tokens=cached)  # fmt: skip


def score_out(
    value: float, n: int = 2, prompt: int = 20, cached: int = 16
) -> llm_engine.RequestOutput:
    out = llm_engine.RequestOutput("s", [0], "", [0], "", True, "length", None,
                                   num_prompt_tokens=prompt, num_cached_tokens=cached)  # fmt: skip
    out.prompt_logprobs = [TokenLogprobs(value)] * n
    return out


def drive(
    params: step_search.StepSearchParams, script: list[list[Any]]
) -> tuple[step_search.SearchResult, list[list[Any]]]:
    """Feeds ``script``'s outputs round by round; returns the result and every call batch."""
    words = Words()
    problem = step_search.Problem(words.encode("Q?\n"), "Q?\n", "Q?")
    run = step_search.search(problem, params, words, None, separate_verifier=True)
    warm = next(run)  # the prompt, computed once before the first round
    assert len(warm) == 1
    assert warm[0].prompt_token_ids == problem.token_ids
    assert warm[0].params.max_tokens == 1
    calls = [run.send([gen_out("w", prompt=3)])]
    for outs in script:
        try:
            calls.append(run.send(outs))
        except StopIteration as stop:
            return stop.value, calls
    raise AssertionError("the search wanted more rounds than scripted")


def test_the_best_paths_continue_finished_ones_are_set_aside() -> None:
    params = step_search.StepSearchParams(num_candidates=3, beam_width=2, max_steps=4, seed=7,
                                          stop=("\n\n",))  # fmt: skip
    script = [
        [gen_out("a\n"), gen_out("b\n"), gen_out("c\n")],
        [score_out(-3.0), score_out(-1.0), score_out(-2.0)],  # b, then c continue
        # b's three candidates, then c's: one of b's ends (an end stop), two repeat
        [gen_out("x\n"), gen_out("x\n"), gen_out("end\n\n", stop_reason="\n\n"),
         gen_out("y\n"), gen_out("z\n"), gen_out("z\n")],
        # scored: b+x, b+end, c+y, c+z (the repeats are not scored twice)
        [score_out(-5.0), score_out(-0.5), score_out(-1.0), score_out(-4.0)],
        # one path is finished, so one continues: c+y (mean -1.5 beats b+x's -3.0)
        [gen_out("q\n"), gen_out("r", stop_reason=None), gen_out("q\n")],
        [score_out(-9.0), score_out(-0.1)],
    ]  # fmt: skip
    result, calls = drive(params, script)
    first, second, third = calls[0], calls[2], calls[4]
    assert len(first) == 3
    assert all(c.prompt_token_ids == [ord(c) for c in "Q?\n"] for c in first)
    assert [c.params.seed for c in first] == [7, 8, 9]  # seeded, distinct, reproducible
    assert {Words().decode(c.prompt_token_ids) for c in second} == {"Q?\nb\n", "Q?\nc\n"}
    assert len(calls[3]) == 4  # the repeated samples are not scored twice
    # b+end finished (mean -0.75), so one path continues: c+y (-1.5) over b+x and c+z (-3)
    assert {Words().decode(c.prompt_token_ids) for c in third} == {"Q?\nc\ny\n"}
    # finished: b+end (-0.75) and c+y+r (EOS, mean(-2, -1, -0.1)); the best is returned,
    # its end stop cut from the text
    assert result.texts == ["b\nend"]
    assert result.paths[0].steps == ["b\n", "end\n\n"]
    assert result.paths[0].finish_reason == "stop"
    assert result.scores == [pytest.approx(-0.75)]
    assert result.num_rounds == 3
    assert result.compute.generator_calls == 13
    assert result.compute.verifier_calls == 9
    assert result.compute.verifier_tokens == 9 * 4  # 20 prompt tokens, 16 cached, each
    two = dataclasses.replace(params, n=2)
    assert drive(two, script)[0].texts == ["b\nend", "c\ny\nr"]


def test_aggregates_max_tokens_and_an_end_stop_across_steps() -> None:
    # an end stop "\n\n" made of two one-"\n" steps ends the path; max_tokens ends the other
    params = step_search.StepSearchParams(num_candidates=2, beam_width=2, max_steps=5,
                                          max_tokens=4, stop=("\n\n",), aggregate="min")  # fmt: skip
    result, calls = drive(params, [
        [gen_out("a\n"), gen_out("bb\n")],
        [score_out(-1.0), score_out(-2.0)],
        [gen_out("\n"), gen_out("\n"), gen_out("c", finish="length", stop_reason=None),
         gen_out("d", finish="length", stop_reason=None)],
        [score_out(-0.5), score_out(-3.0), score_out(-0.2)],
    ])  # fmt: skip
    assert calls[2][0].params.max_tokens == 2  # what is left of max_tokens for "a\n"
    assert calls[2][2].params.max_tokens == 1
    assert [p.finish_reason for p in result.paths] == ["stop"]
    assert result.texts == ["a"]  # the end stop ("\n" + "\n") is cut
    assert result.scores == [-1.0]  # min(-1, -0.5)
    assert params.candidate_params(4, None).stop == ("\n\n", "\n")  # end stops first


def test_the_generator_verifying_itself_scores_from_its_own_logprobs() -> None:
    """No verifier calls: the logprobs of the sampled step are its score."""
    params = step_search.StepSearchParams(num_candidates=2, beam_width=1, max_steps=3)
    words = Words()
    problem = step_search.Problem(words.encode("Q?\n"), "Q?\n", "Q?")
    run = step_search.search(problem, params, words)
    next(run)  # the prompt, once
    (first, _) = run.send([gen_out("w", prompt=3)])
    assert first.params.logprobs == 0  # generation reports what scoring needs

    def scored(text: str, value: float, **kw: Any) -> llm_engine.RequestOutput:
        out = gen_out(text, **kw)
        out.logprobs = [TokenLogprobs(value)] * len(text)
        return out

    calls = run.send([scored("a\n", -2.0), scored("b\n", -1.0)])
    assert all(isinstance(c, step_search.Generate) for c in calls)  # straight to round 2
    assert Words().decode(calls[0].prompt_token_ids) == "Q?\nb\n"
    with pytest.raises(StopIteration) as stop:
        run.send([scored("c", -0.5, stop_reason=None), scored("d", -3.0, stop_reason=None)])
    result = stop.value.value
    assert result.texts == ["b\nc"]
    assert result.scores == [pytest.approx(-0.75)]
    assert result.compute.verifier_calls == 0
    assert result.compute.verifier_tokens == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_candidates", 0, "num_candidates: must be in"),
        ("beam_width", 17, "beam_width: must be in"),
        ("n", 3, "n: must be in"),
        ("temperature", 0.0, "temperature: must be > 0"),
        ("aggregate", "max", "aggregate: must be one of"),
        ("verifier_prompt", "Check: {problem}", "verifier_prompt: must contain {steps}"),
        ("step_delimiters", (), "step_delimiters: at least one"),
    ],
)
def test_search_params_refused_by_name(field: str, value: Any, message: str) -> None:
    params = dataclasses.replace(step_search.StepSearchParams(), **{field: value})
    with pytest.raises(ValueError, match=message):
        params.validate()


# --- on the real model --------------------------------------------------------------------


def test_scores_are_the_verifiers_likelihood_of_each_step_and_prefixes_are_reused(
    real: tuple[llm_engine.LLMEngine, Any],
) -> None:
    engine, hf = real
    assert engine.tokenizer is not None
    text = SHOTS + "Q: 5 + 8 - 3 = ?\nA:"
    problem = step_search.Problem(engine.tokenizer.encode(text), text, text)
    params = step_search.StepSearchParams(num_candidates=3, beam_width=2, max_steps=6,
                                          stop=("\n\n",), seed=3, n=2)  # fmt: skip
    result = step_search.run_offline(problem, params, engine)
    again = step_search.run_offline(problem, params, engine)
    assert again.texts == result.texts
    assert again.scores == result.scores
    assert len(result.paths) == 2
    assert result.scores[0] >= result.scores[1]
    for path in result.paths:
        ids = problem.token_ids + path.token_ids
        ref = hf_logprobs(hf, ids)
        start = len(problem.token_ids)
        for n, score in zip(path.step_lens, path.step_scores, strict=True):
            assert score == pytest.approx(float(ref[start - 1 : start - 1 + n].mean()), abs=2e-4)
            start += n
    # Every round generates from cached blocks of the path so far (the first, from the
    # prompt computed once): far less than every call's whole prompt. The model verifies
    # itself from the logprobs it computed while sampling: no verifier call.
    c = result.compute
    whole = c.generator_calls * len(problem.token_ids)
    assert c.generator_tokens - c.generated_tokens < whole / 4
    assert c.verifier_calls == 0
    # The same search with the verifier reading a template of the same text scores by
    # prompt-logprobs calls instead, to the same scores and paths while the text's tokens
    # are the generated ones (two steps: a lone "\n" step would merge with the previous
    # one into a "\n\n" token when the text is tokenized again); each call computes only
    # the candidate's tail (the context is in the prefix cache).
    two = dataclasses.replace(params, max_steps=2)
    own = step_search.run_offline(problem, two, engine)
    scored = step_search.run_offline(
        problem, dataclasses.replace(two, verifier_prompt="{problem}{steps}"), engine
    )
    assert scored.texts == own.texts
    assert scored.scores == pytest.approx(own.scores, abs=2e-4)
    s = scored.compute
    assert s.verifier_calls > 0
    assert s.verifier_tokens < s.verifier_calls * (16 + params.max_step_tokens)


def test_a_separate_truncated_verifier_scores_in_its_own_cache(
    real: tuple[llm_engine.LLMEngine, Any],
) -> None:
    engine, hf = real
    verifier = llm_engine.LLMEngine(
        draft_mod.truncated(engine.model, 10, "verifier_num_layers"),
        engine.tokenizer,
        llm_engine.EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=1024),
    )
    assert engine.tokenizer is not None
    text = SHOTS + "Q: 2 + 2 - 1 = ?\nA:"
    problem = step_search.Problem(engine.tokenizer.encode(text), text, text)
    params = step_search.StepSearchParams(num_candidates=2, beam_width=1, max_steps=3, seed=1)
    result = step_search.run_offline(problem, params, engine, verifier)
    assert verifier.stats().prefix_cache_queries > 0  # it scored, in its own engine
    short = copy.deepcopy(hf)
    short.model.layers = short.model.layers[:10]
    short.config.num_hidden_layers = 10
    path = result.paths[0]
    ids = problem.token_ids + path.token_ids
    start, n = len(problem.token_ids), path.step_lens[0]
    ten, full = hf_logprobs(short, ids), hf_logprobs(hf, ids)
    # the step is scored by the 10-layer verifier, not by the generator
    assert path.step_scores[0] == pytest.approx(
        float(ten[start - 1 : start - 1 + n].mean()), abs=2e-4
    )
    assert path.step_scores[0] != pytest.approx(
        float(full[start - 1 : start - 1 + n].mean()), abs=1e-2
    )


# --- /v1/search through the openai client ---------------------------------------------------


@pytest.fixture(scope="module")
def servers(
    real_model_dir: Path, real: tuple[llm_engine.LLMEngine, Any]
) -> Iterator[dict[str, str]]:
    """One server whose model verifies itself; one with a 10-layer verifier of its own."""
    engine, _ = real
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for name, layers in (("self", None), ("truncated", 10)):
            settings = config_mod.ServeSettings(
                model=str(real_model_dir), served_model_name="smol", verifier_num_layers=layers
            )
            own = llm_engine.LLMEngine(
                engine.model, engine.tokenizer,
                llm_engine.EngineConfig(num_kv_blocks=96, block_size=16, max_model_len=1024),
            )  # fmt: skip
            verifier = verifier_mod.load(settings, own)
            app = app_mod.create_app(settings, own, verifier)
            urls[name] = stack.enter_context(serve(app))
            assert httpx.get(urls[name] + "/health", timeout=60).status_code == 200
        yield urls


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.post("/search", body=body, cast_to=object)  # type: ignore[return-value]


@pytest.mark.parametrize("which", ["self", "truncated"])
def test_search_endpoint_answers_with_paths_scores_and_compute(
    servers: dict[str, str], which: str
) -> None:
    body = {
        "model": "smol",
        "prompt": SHOTS + "Q: 4 + 3 - 2 = ?\nA:",
        "num_candidates": 3,
        "beam_width": 2,
        "n": 2,
        "max_steps": 5,
        "stop": "\n\n",
        "seed": 5,
    }
    resp = post(servers[which], body)
    assert resp["object"] == "search"
    assert resp["model"] == "smol"
    assert len(resp["choices"]) == 2
    best, second = resp["choices"]
    assert best["score"] >= second["score"]
    assert "".join(best["steps"]).startswith(best["text"])
    assert "\n\n" not in best["text"]
    assert len(best["step_scores"]) == len(best["steps"])
    c = resp["compute"]
    assert c["total_tokens"] == c["generator_tokens"] + c["verifier_tokens"] > 0
    assert c["generator_calls"] >= 3
    assert c["rounds"] >= 1
    assert resp["usage"]["prompt_tokens"] > 0
    assert post(servers[which], body)["choices"] == resp["choices"]  # seeded
    metrics = httpx.get(servers[which] + "/metrics").text
    assert 'hybridllm_search_computed_tokens_total{model="verifier"}' in metrics
    # chat messages go through the chat template
    chat = post(servers[which], {"messages": [{"role": "user", "content": "Say hi."}],
                                 "max_steps": 2, "num_candidates": 2, "beam_width": 1})  # fmt: skip
    assert chat["choices"][0]["steps"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
        ({"prompt": "x", "temperature": 0}, "temperature"),
        ({"prompt": "x", "beam_width": 2, "n": 3}, "n"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "verifier": {"prompt": "no steps here"}}, "verifier_prompt"),
        ({"prompt": "x", "verifier": {"aggregate": "max"}}, "verifier.aggregate"),
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "x", "model": "other"}, "model"),
    ],
)
def test_search_endpoint_refuses_bad_input_by_name(
    servers: dict[str, str], body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        post(servers["self"], body)
    assert err.value.status_code in (400, 404)
    error = err.value.body
    if param is not None:
        assert error["param"] == param, error  # type: ignore[index]


def test_verifier_settings_are_checked(real_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="verifier_kv_fraction: only with"):
        config_mod.ServeSettings(model=str(real_model_dir), verifier_kv_fraction=0.5)
    with pytest.raises(ValueError, match="verifier_model: a verifier is loaded only in the"):
        config_mod.ServeSettings(model=str(real_model_dir), verifier_num_layers=2,
                                 role="decode", prefill_url="tcp://127.0.0.1:1")  # fmt: skip
    split = config_mod.ServeSettings(model=str(real_model_dir), verifier_num_layers=2,
                                     kv_cache_memory_gib=1.0, verifier_kv_fraction=0.25)  # fmt: skip
    assert split.engine_config().kv_cache_memory_bytes == 3 << 28
    assert split.verifier_engine_config().kv_cache_memory_bytes == 1 << 28
