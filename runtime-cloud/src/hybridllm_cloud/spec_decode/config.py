"""Speculative decoding settings of the engine, and the checks that refuse bad combinations.

Everything here is checked before a model is loaded where possible (``validate``), so a
wrong flag fails start-up with a message naming it, never a request later. The draft
model's vocabulary can only be compared once it is loaded (``check_draft``).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method=None``: speculation off (the default; the engine behaves as without it).

    ``num_speculative_tokens`` (k) is the most tokens proposed per request and step; the
    scheduler proposes fewer near ``max_tokens``, the context end or the step's token
    budget. ``prompt_lookup_max``/``_min``: the n-gram sizes tried, longest first.
    ``draft_model``: a model store URI or an HF-layout directory of a smaller causal LM
    with the target's vocabulary; ``draft_num_layers`` keeps only its first N decoder
    layers (of the target itself when no ``draft_model`` is given: a truncated-layer draft
    that shares the target's weights).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    draft_model: str | None = None
    draft_num_layers: int | None = None

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def uses_draft(self) -> bool:
        return self.method == "draft"

    def validate(self) -> None:
        """Raises ValueError naming the setting (the CLI prints it and exits 2)."""
        if self.method is None:
            return
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_method: {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens: must be >= 1")
        if self.method == "ngram":
            if self.prompt_lookup_min < 1:
                raise ValueError("ngram_prompt_lookup_min: must be >= 1")
            if self.prompt_lookup_max < self.prompt_lookup_min:
                raise ValueError(
                    "ngram_prompt_lookup_max: must be >= ngram_prompt_lookup_min "
                    f"({self.prompt_lookup_max} < {self.prompt_lookup_min})"
                )
            if self.draft_model is not None or self.draft_num_layers is not None:
                raise ValueError(
                    "speculative_draft_model / speculative_draft_num_layers: only for "
                    "--speculative-method draft"
                )
        if self.method == "draft":
            if self.draft_model is None and self.draft_num_layers is None:
                raise ValueError(
                    "speculative_method: draft needs --speculative-draft-model PATH or "
                    "--speculative-draft-num-layers N (the target's first N layers)"
                )
            if self.draft_num_layers is not None and self.draft_num_layers < 1:
                raise ValueError("speculative_draft_num_layers: must be >= 1")


def check_draft(
    target_vocab: int, draft_vocab: int, available_layers: int, draft_layers: int | None
) -> None:
    """Refuses a draft the target cannot verify: token ids must mean the same thing."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_draft_model: its vocabulary of {draft_vocab} tokens differs from the "
            f"target's {target_vocab}; a draft must share the target's tokenizer"
        )
    if draft_layers is not None and draft_layers > available_layers:
        raise ValueError(
            f"speculative_draft_num_layers: {draft_layers} is more than the "
            f"{available_layers} layers the model has"
        )
