"""A minimal greedy decoder over the exported ONNX graph (numpy + onnxruntime, no torch).

It is the reference use of the graph's past key/value interface, used by the tests and the
quality benchmark; the edge runtime has its own serving loop over the same interface.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hybridllm_models import onnx_export


class OnnxCausalLM:
    def __init__(self, model_dir: Path, num_threads: int = 1) -> None:
        import onnxruntime as ort

        config = json.loads((model_dir / "config.json").read_text())
        self.num_layers = config["num_hidden_layers"]
        self.num_kv = config.get("num_key_value_heads", config["num_attention_heads"])
        self.head_dim = (
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(model_dir / onnx_export.MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        self.input_names, self.output_names = onnx_export.io_names(self.num_layers)

    def empty_past(self, batch: int = 1) -> list[np.ndarray]:
        shape = (batch, self.num_kv, 0, self.head_dim)
        return [np.zeros(shape, dtype=np.float32) for _ in range(2 * self.num_layers)]

    def forward(
        self, ids: list[int], past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits [seq, vocab] for ids following the cached past; returns the new past."""
        past_len = past[0].shape[2]
        feeds = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, past_len + len(ids)), dtype=np.int64),
            "position_ids": np.arange(past_len, past_len + len(ids), dtype=np.int64)[None, :],
        }
        feeds.update(zip(self.input_names[3:], past, strict=True))
        logits, *present = self.session.run(self.output_names, feeds)
        return logits[0], present

    def greedy(self, prompt_ids: list[int], num_new: int, eos_id: int | None = None) -> list[int]:
        logits, past = self.forward(prompt_ids, self.empty_past())
        out: list[int] = []
        for _ in range(num_new):
            token = int(logits[-1].argmax())
            out.append(token)
            if token == eos_id:
                break
            logits, past = self.forward([token], past)
        return out
