"""GGUF -> Hugging Face: the converted model loads in transformers and behaves like the GGUF.

Exact token equality with llama.cpp is not the right bar: llama.cpp multiplies Q4_1
weights with activations it quantizes to 8 bits, while transformers runs the dequantized
weights in fp32, so near-ties between the top two logits can flip (on "What is the
capital of France?" llama.cpp's first token is "L" at 24.91 over "The" at 24.56;
transformers has "The" 25.33 over "L" 25.24). What must hold: teacher-forced on the
transformers greedy continuation, llama.cpp picks the same next token almost everywhere,
and the logits correlate nearly perfectly. A wrong Q/K permutation, tokenizer or RoPE
setting drops the agreement far below these bounds (to a few percent).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hybridllm_models import gguf_to_hf

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]
NUM_NEW_TOKENS = 20


def test_unpermute_inverts_permute() -> None:
    weight = np.random.default_rng(0).standard_normal((3 * 64, 40)).astype(np.float32)
    np.testing.assert_array_equal(gguf_to_hf.unpermute(gguf_to_hf.permute(weight, 3), 3), weight)
    assert not np.array_equal(gguf_to_hf.permute(weight, 3), weight)


def test_layout_and_config(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        576,
        30,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


@pytest.fixture(scope="module")
def llama_vocab(shipped_gguf: Path):  # type: ignore[no-untyped-def]
    import llama_cpp

    return llama_cpp.Llama(str(shipped_gguf), vocab_only=True, verbose=False)


TEXTS = [
    "Hello world! 12345 numbers and 3.14159",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé — emoji 🤖, 中文, Ελληνικά, كلمة",
    "def f(x):\n    return x ** 2  # squared",
    "I'm sure you'll see they've done it; we'd've known.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_llama_cpp(hf_dir: Path, llama_vocab, text: str) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(
        text, add_special_tokens=False
    )
    theirs = llama_vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert ours.ids == theirs
    assert ours.ids
    assert (
        Tokenizer.from_file(str(hf_dir / "tokenizer.json")).decode(
            ours.ids, skip_special_tokens=False
        )
        == text
    )


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_transformers_fp32_agrees_with_llama_cpp(hf_dir: Path, shipped_gguf: Path) -> None:
    import llama_cpp
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = llama_cpp.Llama(str(shipped_gguf), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    num_agree = num_total = 0
    correlations = []
    answers: list[str] = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
            )
        sequence = out[0].tolist()
        new = sequence[len(ids) :]
        answers.append(tokenizer.decode(new, skip_special_tokens=True))
        llm.reset()
        llm.eval(sequence)
        scores = np.asarray(llm.scores[: len(sequence)])
        predicted = scores[len(ids) - 1 : len(sequence) - 1].argmax(-1)
        num_agree += int((predicted == np.asarray(new)).sum())
        num_total += len(new)
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].numpy()
        correlations.append(np.corrcoef(scores[-1], logits[-1])[0, 1])
    assert num_agree / num_total >= 0.85, (
        f"llama.cpp agreed on {num_agree}/{num_total} greedy tokens"
    )
    assert min(correlations) > 0.98
    assert "Paris" in answers[0]
