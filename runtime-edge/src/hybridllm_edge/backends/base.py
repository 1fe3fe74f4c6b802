"""The one backend interface the engine drives: tokens in, last-token logits out, per slot.

A backend owns the model and its KV state for ``num_slots`` sequences (slots). The engine
(one thread) calls ``forward`` with a step's worth of work: for each slot, the next tokens
to append at a position, and whether it wants the logits of the last one. A decoding slot
sends one token; a prefilling slot sends a chunk of its prompt. ``release`` drops a slot's
KV; ``truncate`` keeps a prefix of it for a next request that shares it (the prompt cache). Sampling, detokenization, stop strings and
scheduling live in the engine, so both backends behave the same to the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridllm_common import structured


@dataclass(frozen=True)
class BackendInfo:
    name: str  # "llamacpp" | "onnx"
    model_path: str
    revision: str  # identifies the weights (sha256 from the store manifest, or the file's)
    vocab_size: int
    max_model_len: int  # tokens per slot
    num_slots: int
    eos_token_ids: frozenset[int]
    bos_token: str = ""
    eos_token: str = ""
    chat_template: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class SlotWork:
    slot: int
    token_ids: list[int]
    pos: int  # position of token_ids[0] in the sequence
    want_logits: bool


class Backend(Protocol):
    info: BackendInfo

    def encode(self, text: str, add_special: bool) -> list[int]:
        """Token ids of text; control tokens written in it (``<|im_start|>``) are parsed."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a multi-byte character may span tokens)."""
        ...

    def grammar_vocabulary(self) -> structured.Vocabulary:
        """The vocabulary as structured output's matcher sees it (built once, ~0.2-1 s)."""
        ...

    def forward(self, work: list[SlotWork]) -> np.ndarray:
        """Logits [num_wanting, vocab] float32 of the last token of each item wanting them."""
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's KV (cancellation, a failed step)."""
        ...

    def truncate(self, slot: int, keep: int) -> int:
        """Keep the KV of the slot's first ``keep`` positions and forget the rest (a new
        request that shares that prefix with what the slot held); returns the positions
        kept (0 where the backend cannot cut the KV, which is then emptied)."""
        ...

    def copy(self, src: int, dst: int) -> None:
        """Give slot ``dst`` a copy of slot ``src``'s KV (then cut to a prefix with
        ``truncate``): a prompt prefix computed once serves several slots."""
        ...

    def slot_length(self, slot: int) -> int:
        """Tokens the slot holds in its KV (0 when free)."""
        ...

    def close(self) -> None: ...
