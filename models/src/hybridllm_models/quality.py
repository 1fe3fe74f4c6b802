"""The quality check: does a stored variant still compute what the fp32 model computes?

A file can be intact (every sha256 right) and still answer nonsense on the machine that
runs it: onnxruntime's u8 x s8 int8 kernels saturate on x86 CPUs without VNNI, a quantizer
can write wrong scales, a runtime can load a file wrongly. Hashes catch none of that, so
every converted artifact carries *reference outputs* in its manifest and every consumer
compares its own outputs against them:

- at conversion, the fp32 model (our plain-torch decoder over the ``hf`` artifact) runs a
  few fixed prompts; for every position the manifest keeps the ``TOP_K`` most likely next
  tokens and their log-probabilities (about 30 KB of JSON), with the tolerance of the
  target (``TOLERANCES``);
- at load, a runtime (the edge runtime's llama.cpp and onnxruntime backends) or
  ``hybridllm model verify`` computes the same positions with its own code, on its own CPU,
  and ``compare`` measures two numbers:

  * **KL divergence** from the reference's next-token distribution to the variant's, on
    the reference's top-K tokens plus one bucket for the rest of the vocabulary: a proper
    KL between two coarse-grained distributions, a lower bound of the full one, and the
    measure llama.cpp's ``perplexity --kl-divergence`` reports for quantized files;
  * **top-1 agreement**: how often the variant's most likely token is the reference's.

A variant outside its tolerance is refused with both numbers and both limits in the
message. The tolerances were set from measurements on this model (bench/results/models.md
lists each variant's numbers): a few times the worst sound variant of each kind, and far
below what a broken file gives (a mis-scaled or saturating int8 graph: KL above 1 nat,
top-1 under 30%).

This module needs numpy only; the fp32 reference is computed by the caller (conversions
have torch), and the variants' logits by whoever loads them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np
import pydantic

from hybridllm_models import errors

log = logging.getLogger(__name__)

TOP_K = 16

# Fixed texts, tokenized with the model's own tokenizer at conversion time (their ids are
# stored, so the check needs no tokenizer). Chat, code, facts and narrative, ~100 positions.
PROMPTS = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is Paris.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Water boils at 100 degrees Celsius at sea level. The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)


@dataclasses.dataclass(frozen=True)
class Tolerance:
    max_kl: float  # mean KL (nats) over all positions
    min_top1: float  # fraction of positions whose most likely token agrees


# Per weight type: a few times what the sound variant of each type measured on SmolLM2-135M
# (KL / top-1 over the 100 positions: bf16 and F16 0.0000 / 100%, Q8_0 0.003 / 98%,
# int8 0.011 / 93%, Q4_K_M 0.043 / 88%, Q4_0 0.30 / 73%), and far from broken files
# (per-tensor dynamic int8 0.49 / 70%, the saturating one 14.0 / 0%). fp32 variants
# reproduce the reference up to summation order.
TOLERANCES: dict[str, Tolerance] = {
    "f32": Tolerance(max_kl=0.01, min_top1=0.97),
    "bf16": Tolerance(max_kl=0.05, min_top1=0.90),
    "F16": Tolerance(max_kl=0.05, min_top1=0.90),
    "Q8_0": Tolerance(max_kl=0.03, min_top1=0.88),
    "int8": Tolerance(max_kl=0.03, min_top1=0.85),
    "Q4_K_M": Tolerance(max_kl=0.20, min_top1=0.75),
    "Q4_0": Tolerance(max_kl=0.80, min_top1=0.60),
}


class Position(pydantic.BaseModel):
    ids: list[int] = pydantic.Field(
        description="the reference's top-K next tokens, most likely first"
    )
    logprobs: list[float] = pydantic.Field(description="their log-probabilities (full vocabulary)")


class Reference(pydantic.BaseModel):
    """Reference outputs of the fp32 model on fixed prompts, and the variant's tolerance."""

    computed_with: str = pydantic.Field(description="what produced the reference logits")
    prompts: list[list[int]] = pydantic.Field(description="token ids of each fixed prompt")
    positions: list[list[Position]] = pydantic.Field(
        description="per prompt, per position: the next-token distribution after it"
    )
    max_kl: float
    min_top1: float


@dataclasses.dataclass(frozen=True)
class Result:
    mean_kl: float
    top1: float
    num_positions: int
    max_kl: float
    min_top1: float

    @property
    def ok(self) -> bool:
        return self.mean_kl <= self.max_kl and self.top1 >= self.min_top1

    def describe(self) -> str:
        kl = f"KL {self.mean_kl:.4f} nats (limit {self.max_kl})"
        top1 = f"top-1 agreement {self.top1:.1%} (limit {self.min_top1:.0%})"
        return f"{kl}, {top1} over {self.num_positions} positions"

    def failure(self) -> str:
        """Which check failed and by how much."""
        failed = []
        if self.mean_kl > self.max_kl:
            failed.append(
                f"KL divergence from the fp32 reference is {self.mean_kl:.4f} nats, "
                f"{self.mean_kl / self.max_kl:.1f}x the limit of {self.max_kl}"
            )
        if self.top1 < self.min_top1:
            failed.append(
                f"top-1 agreement with the fp32 reference is {self.top1:.1%}, "
                f"under the limit of {self.min_top1:.0%}"
            )
        return "; ".join(failed)


class QualityError(errors.ModelStoreError):
    """A variant's outputs are too far from its reference: it must not serve."""

    def __init__(self, what: str, result: Result, target: str = "TARGET") -> None:
        super().__init__(
            f"{what} failed its quality check: {result.failure()} "
            f"({result.num_positions} positions on fixed prompts). The file, or the kernels "
            f"this CPU runs for it, compute something other than the model: rebuild it with "
            f"`hybridllm model convert --force --to {target}`, or serve another variant"
        )
        self.result = result


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def tolerance_for(quantization: str) -> Tolerance:
    try:
        return TOLERANCES[quantization]
    except KeyError:
        raise errors.ConversionError(
            f"no quality tolerance for weights of type {quantization!r}; "
            f"known: {', '.join(TOLERANCES)}"
        ) from None


def make_reference(
    prompts: Sequence[Sequence[int]],
    logits: Sequence[np.ndarray],
    quantization: str,
    computed_with: str,
) -> Reference:
    """The reference from the fp32 model's logits [len(prompt), vocab] of each prompt."""
    tolerance = tolerance_for(quantization)
    positions = []
    for rows in logits:
        lp = log_softmax(rows)
        top = np.argsort(-lp, axis=-1, kind="stable")[:, :TOP_K]
        positions.append(
            [
                Position(
                    ids=[int(i) for i in top[p]],
                    logprobs=[round(float(lp[p, i]), 5) for i in top[p]],
                )
                for p in range(lp.shape[0])
            ]
        )
    return Reference(
        computed_with=computed_with,
        prompts=[list(map(int, p)) for p in prompts],
        positions=positions,
        max_kl=tolerance.max_kl,
        min_top1=tolerance.min_top1,
    )


def compare(reference: Reference, logits: Sequence[np.ndarray]) -> Result:
    """Score a variant's logits [len(prompt), vocab] per prompt against the reference."""
    kls: list[float] = []
    agree = 0
    for prompt, expected, rows in zip(reference.prompts, reference.positions, logits, strict=True):
        if rows.shape[0] != len(prompt) or len(expected) != len(prompt):
            raise ValueError(f"expected logits for {len(prompt)} positions, got {rows.shape[0]}")
        lq = log_softmax(rows)
        for p, pos in enumerate(expected):
            ids = np.asarray(pos.ids)
            p_top = np.exp(np.asarray(pos.logprobs, dtype=np.float64))
            q_top = np.exp(lq[p, ids])
            p_rest = max(1.0 - p_top.sum(), 1e-12)
            q_rest = max(1.0 - q_top.sum(), 1e-12)
            kl = float((p_top * (np.log(p_top) - np.log(np.maximum(q_top, 1e-30)))).sum())
            kl += p_rest * (np.log(p_rest) - np.log(q_rest))
            kls.append(max(kl, 0.0))
            agree += int(np.argmax(lq[p])) == pos.ids[0]
    if not kls:
        raise ValueError("the reference has no positions")
    return Result(
        mean_kl=float(np.mean(kls)),
        top1=agree / len(kls),
        num_positions=len(kls),
        max_kl=reference.max_kl,
        min_top1=reference.min_top1,
    )


def check(
    reference: Reference,
    prompt_logits: Callable[[list[int]], np.ndarray],
    what: str,
    target: str = "TARGET",
) -> Result:
    """Run the variant on the reference prompts; raise QualityError when out of tolerance."""
    result = compare(reference, [prompt_logits(list(p)) for p in reference.prompts])
    if not result.ok:
        raise QualityError(what, result, target)
    log.debug("%s passed its quality check: %s", what, result.describe())
    return result
