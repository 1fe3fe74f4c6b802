"""Chat messages -> prompt text through the model's own chat template (jinja2, sandboxed).

The template comes from the model: ``tokenizer.chat_template`` in the GGUF metadata, or
``chat_template`` in the ONNX export's ``tokenizer_config.json``. It is rendered the way
transformers' ``apply_chat_template`` does (``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``), so both backends build the same prompt for the same messages.
"""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, for a model that ships no template.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source or FALLBACK_TEMPLATE)
        self._bos, self._eos = bos_token, eos_token
        self.source = source

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=self._bos,
            eos_token=self._eos,
        )
