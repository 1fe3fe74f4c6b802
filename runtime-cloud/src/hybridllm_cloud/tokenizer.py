"""Tokenizer, chat template and incremental detokenisation.

``tokenizers`` does the encoding; the chat template is the model's own Jinja template
(``chat_template`` in ``tokenizer_config.json`` or a ``chat_template.jinja`` file),
rendered in a sandboxed Jinja environment the way transformers renders it
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``). The rendered text is encoded
without adding special tokens, since the template already wrote them.

Detokenisation is incremental (vLLM's prefix/read offsets): each new token decodes a short
window and emits the text beyond what the window decoded before, holding text back while
it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_ids: tuple[int, ...] = ()
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids = (self.tok.token_to_id(self.eos_token),)
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
            self.eos_token_ids = tuple(dict.fromkeys([*self.eos_token_ids, *map(int, ids)]))
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        text = self.tok.decode([token_id], skip_special_tokens=False)
        return text if text else (self.tok.id_to_token(token_id) or "")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@dataclass
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    prompt_tail: list[int] = field(default_factory=list)  # a few prompt ids for context
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_tail)
        self.prefix_offset = max(len(self.token_ids) - 5, 0)
        self.read_offset = len(self.token_ids)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the newly decodable text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += new
            return new
        return ""
