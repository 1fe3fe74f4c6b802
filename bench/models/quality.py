"""Quality and speed of every format of SmolLM2-135M-Instruct, measured in one run.

    uv run python bench/models/quality.py            # writes bench/results/models.{md,json,png}

For each format/precision (torch fp32 and bf16 through transformers; GGUF f16, Q8_0,
Q4_K_M, Q4_0 and the shipped Q4_1 through llama-cpp-python; ONNX fp32 and int8 through
onnxruntime) it measures:

- perplexity on bench/data/perplexity.txt (non-overlapping 512-token windows, the same
  token ids for every format, from the converted tokenizer.json);
- greedy agreement with torch fp32 over N chat prompts x T new tokens (EOS ignored): the
  mean fraction of the T tokens before the first divergence, and how many prompts match
  exactly;
- file size, load time (median of 3 loads), and single-stream decode tokens/s (median over
  the prompts; one thread per backend, since the 2-core machine is shared and noisy).

torch fp32 is the peer every other row is compared with, in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import hybridllm_models

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "bench" / "data" / "perplexity.txt"
WINDOW = 512
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Name three colors.",
    "What is 2 + 2?",
    "Give me a tip for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
    "Write a short greeting for a birthday card.",
    "List three fruits that are red.",
    "How many days are in a week?",
    "What does a computer's CPU do?",
    "Suggest a name for a pet cat.",
    "Why do we need to drink water?",
    "Describe a rainy day in two sentences.",
    "What is the largest planet in the solar system?",
    "How do I boil an egg?",
    "What is the opposite of 'hot'?",
    "Give an example of a mammal that lives in the ocean.",
    "Summarize the story of Cinderella in one sentence.",
]


class TorchBackend:
    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, dtype

    def load(self) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]
        self.model = LlamaForCausalLM.from_pretrained(self.path, dtype=dtype).eval()

    def logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0].float().numpy()

    def greedy(self, ids: list[int], num_new: int) -> tuple[list[int], float]:
        torch = self.torch
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            start = time.perf_counter()
            for _ in range(num_new - 1):
                out = self.model(
                    input_ids=torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
                tokens.append(int(out.logits[0, -1].argmax()))
        return tokens, (num_new - 1) / (time.perf_counter() - start)


class LlamaCppBackend:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            str(self.path),
            n_ctx=WINDOW + 128,
            n_batch=WINDOW,
            n_threads=1,
            logits_all=True,
            verbose=False,
        )

    def logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy(self, ids: list[int], num_new: int) -> tuple[list[int], float]:
        llm = self.llm
        llm.reset()
        llm.eval(ids)
        tokens = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
        start = time.perf_counter()
        for _ in range(num_new - 1):
            llm.eval([tokens[-1]])
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        return tokens, (num_new - 1) / (time.perf_counter() - start)


class OnnxBackend:
    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> None:
        from hybridllm_models.onnx_runner import OnnxCausalLM

        self.model = OnnxCausalLM(self.path, num_threads=1)

    def logits(self, ids: list[int]) -> np.ndarray:
        return self.model.forward(ids, self.model.empty_past())[0]

    def greedy(self, ids: list[int], num_new: int) -> tuple[list[int], float]:
        logits, past = self.model.forward(ids, self.model.empty_past())
        tokens = [int(logits[-1].argmax())]
        start = time.perf_counter()
        for _ in range(num_new - 1):
            logits, past = self.model.forward([tokens[-1]], past)
            tokens.append(int(logits[-1].argmax()))
        return tokens, (num_new - 1) / (time.perf_counter() - start)


FORMATS: list[tuple[str, str, Any]] = [
    ("torch fp32", "hf", lambda p: TorchBackend(p, "fp32")),
    ("torch bf16", "hf-bf16", lambda p: TorchBackend(p, "bf16")),
    ("GGUF f16", "gguf-f16", LlamaCppBackend),
    ("GGUF Q8_0", "gguf-q8_0", LlamaCppBackend),
    ("GGUF Q4_K_M", "gguf-q4_k_m", LlamaCppBackend),
    ("GGUF Q4_0", "gguf-q4_0", LlamaCppBackend),
    ("GGUF Q4_1 (shipped)", "gguf", LlamaCppBackend),
    ("ONNX fp32", "onnx", OnnxBackend),
    ("ONNX int8", "onnx-int8", OnnxBackend),
]


def perplexity(backend: Any, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids), WINDOW):
        chunk = ids[start : start + WINDOW]
        if len(chunk) < 2:
            continue
        logits = backend.logits(chunk)[:-1].astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll += float((logz - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def model_bytes(artifact: hybridllm_models.Artifact) -> int:
    m = artifact.manifest
    return sum(f.size for f in m.files if f.path.endswith((".gguf", ".safetensors", ".onnx")))


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration, ValueError):
        mem_kb = 0
    return f"{os.cpu_count()} cores, {cpu}, {mem_kb / 2**20:.0f} GiB RAM, {platform.system()} {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "models")
    args = parser.parse_args(argv)

    import jinja2
    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    hf = hybridllm_models.ensure(target="hf")
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    text_ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False).ids
    template = jinja2.Environment().from_string(
        json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    )
    prompts = [
        tokenizer.encode(
            template.render(messages=[{"role": "user", "content": p}], add_generation_prompt=True),
            add_special_tokens=False,
        ).ids
        for p in PROMPTS[: args.prompts]
    ]

    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []
    for label, target, make in FORMATS:
        artifact = hybridllm_models.ensure_artifact(target=target)
        backend = make(artifact.primary_path)
        load_times = []
        for _ in range(args.loads):
            start = time.perf_counter()
            backend.load()
            load_times.append(time.perf_counter() - start)
        ppl = perplexity(backend, text_ids)
        outputs, rates = [], []
        for ids in prompts:
            tokens, rate = backend.greedy(ids, args.tokens)
            outputs.append(tokens)
            rates.append(rate)
        if not reference:
            reference = outputs
        prefixes = []
        for ours, ref in zip(outputs, reference, strict=True):
            same = next(
                (i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), len(ref)
            )
            prefixes.append(same / len(ref))
        row = {
            "format": label,
            "target": target,
            "quantization": artifact.manifest.quantization,
            "perplexity": ppl,
            "greedy_prefix_agreement": statistics.mean(prefixes),
            "exact_prompts": sum(p == 1.0 for p in prefixes),
            "file_mb": model_bytes(artifact) / 1e6,
            "load_s": statistics.median(load_times),
            "tokens_per_s": statistics.median(rates),
            "sample": tokenizer.decode(outputs[0][:24]),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        del backend

    command = "uv run python bench/models/quality.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_results(args, rows, command.strip(), len(text_ids))
    return 0


def write_results(
    args: argparse.Namespace, rows: list[dict[str, Any]], command: str, num_text: int
) -> None:
    base = rows[0]
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "prompts": args.prompts,
        "new_tokens": args.tokens,
        "text_tokens": num_text,
        "threads_per_backend": 1,
        "peer": base["format"],
    }
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Model formats: what INT8 and INT4 cost (SmolLM2-135M-Instruct)",
        "",
        f"- Machine: {meta['machine']} (shared with other jobs; ratios against the peer "
        "measured in the same run are the numbers to trust)",
        f"- Command: `{command}`",
        f"- Date: {meta['date']}",
        f"- Perplexity: `bench/data/perplexity.txt`, {num_text} tokens, {WINDOW}-token windows.",
        f"- Greedy agreement: {args.prompts} chat prompts x {args.tokens} new tokens, EOS ignored, "
        "against torch fp32; 'prefix' = mean fraction of tokens before the first divergence.",
        f"- Speed: single stream, 1 thread per backend, decode tokens/s median over the prompts; "
        f"load time median of {args.loads}. Peer: {base['format']}.",
        "",
        "| format | quant | perplexity | vs fp32 | greedy prefix agreement | identical prompts | "
        "file MB | load s | tokens/s | tokens/s vs fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['quantization']} | {r['perplexity']:.2f} | "
            f"{r['perplexity'] / base['perplexity']:.3f}x | {r['greedy_prefix_agreement']:.1%} | "
            f"{r['exact_prompts']}/{args.prompts} | {r['file_mb']:.0f} | {r['load_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )
    lines += ["", 'First 24 greedy tokens of prompt 1 ("What is the capital of France?"):', ""]
    lines += [f"- {r['format']}: {r['sample']!r}" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["format"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("perplexity", "perplexity (lower is better)"),
        ("greedy_prefix_agreement", "greedy agreement with torch fp32"),
        ("tokens_per_s", "decode tokens/s, 1 thread"),
    )
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.barh(labels, [r[key] for r in rows], color="tab:blue")
        ax.set_title(title)
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.suptitle("SmolLM2-135M-Instruct: formats and precisions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
