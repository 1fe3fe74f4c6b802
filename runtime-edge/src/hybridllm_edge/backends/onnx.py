"""onnxruntime backend over the store's ONNX export with past key/values (fp32 or int8).

The graph (see ``hybridllm_models.onnx_export``) takes ``input_ids``, ``attention_mask``
[batch, past + seq], ``position_ids`` and one past key and value per layer, and returns the
logits and the presents. Decoding is incremental: each slot keeps its presents as numpy
arrays and feeds them back with one new token.

Decoding slots share one ``session.run``: their pasts are left-padded to the longest with
``attention_mask`` 0 over the padding (the graph masks it out) and explicit position ids,
and the presents are cut back per slot afterwards. Prefill chunks run one slot at a time
(their lengths differ, and a prompt is one matmul-heavy call anyway). Tokenization is the
export's ``tokenizer.json`` through ``tokenizers``; no torch, no transformers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tokenizers

from hybridllm_common import structured
from hybridllm_edge import config
from hybridllm_edge.backends.base import BackendInfo, SlotWork

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte table, inverted (byte-level BPE pieces to bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class OnnxBackend:
    def __init__(self, path: Path, revision: str, settings: config.EdgeSettings) -> None:
        folder = path if path.is_dir() else path.parent
        cfg = json.loads((folder / "config.json").read_text())
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.num_layers = cfg["num_hidden_layers"]
        self.num_kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        threads = settings.threads or max(1, (os.cpu_count() or 2) // 2)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"]
        )
        past = [
            f"past_key_values.{i}.{k}" for i in range(self.num_layers) for k in ("key", "value")
        ]
        present = [f"present.{i}.{k}" for i in range(self.num_layers) for k in ("key", "value")]
        self.past_names, self.output_names = past, ["logits", *present]
        self.tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._add_bos = bool(tok_cfg.get("add_bos_token", False))
        self._bos_id = gen.get("bos_token_id", cfg.get("bos_token_id"))
        self._pieces = self._token_pieces()
        eos: set[int] = set()
        for value in (gen.get("eos_token_id"), cfg.get("eos_token_id")):
            eos |= (
                set(value) if isinstance(value, list) else {value} if value is not None else set()
            )
        for name in (tok_cfg.get("eos_token"), "<|endoftext|>"):
            if isinstance(name, str) and (tid := self.tokenizer.token_to_id(name)) is not None:
                eos.add(tid)
        train_len = cfg.get("max_position_embeddings", settings.max_model_len)
        self.info = BackendInfo(
            name="onnx",
            model_path=str(folder),
            revision=revision,
            vocab_size=self.tokenizer.get_vocab_size(),
            max_model_len=min(settings.max_model_len, train_len),
            num_slots=settings.parallel,
            eos_token_ids=frozenset(eos),
            bos_token=str(tok_cfg.get("bos_token") or ""),
            eos_token=str(tok_cfg.get("eos_token") or ""),
            chat_template=tok_cfg.get("chat_template"),
            extra={"threads": str(threads)},
        )
        self._pasts: list[list[np.ndarray] | None] = [None] * settings.parallel

    def _token_pieces(self) -> list[bytes]:
        table = _byte_decoder()
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        pieces = []
        for tid in range(self.tokenizer.get_vocab_size()):
            token = self.tokenizer.id_to_token(tid) or ""
            if token in special or any(ch not in table for ch in token):
                pieces.append(token.encode("utf-8"))
            else:
                pieces.append(bytes(table[ch] for ch in token))
        return pieces

    def grammar_vocabulary(self) -> structured.Vocabulary:
        return structured.Vocabulary.from_tokenizer_json(
            self.tokenizer.to_str(), self.info.vocab_size, sorted(self.info.eos_token_ids)
        )

    def encode(self, text: str, add_special: bool) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def _empty(self) -> list[np.ndarray]:
        shape = (1, self.num_kv, 0, self.head_dim)
        return [np.zeros(shape, dtype=np.float32) for _ in range(2 * self.num_layers)]

    def _run(
        self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        feeds.update(zip(self.past_names, past, strict=True))
        logits, *present = self.session.run(self.output_names, feeds)
        return logits, present

    def forward(self, work: list[SlotWork]) -> np.ndarray:
        rows: dict[int, np.ndarray] = {}
        decode = [w for w in work if len(w.token_ids) == 1 and self._pasts[w.slot] is not None]
        for w in work:
            if w in decode:
                continue
            past = self._pasts[w.slot] if w.pos > 0 else self._empty()
            assert past is not None
            n = len(w.token_ids)
            logits, present = self._run(
                np.asarray([w.token_ids], dtype=np.int64),
                np.ones((1, w.pos + n), dtype=np.int64),
                np.arange(w.pos, w.pos + n, dtype=np.int64)[None, :],
                past,
            )
            self._pasts[w.slot] = present
            rows[w.slot] = logits[0, -1]
        if decode:
            rows.update(self._decode(decode))
        return np.stack([rows[w.slot] for w in work if w.want_logits]).astype(np.float32)

    def _decode(self, work: list[SlotWork]) -> dict[int, np.ndarray]:
        """One token for each slot in one run, pasts left-padded to the longest."""
        lengths = [w.pos for w in work]
        longest = max(lengths)
        batch = len(work)
        mask = np.zeros((batch, longest + 1), dtype=np.int64)
        padded: list[np.ndarray] = []
        for layer in range(2 * self.num_layers):
            buf = np.zeros((batch, self.num_kv, longest, self.head_dim), dtype=np.float32)
            for b, w in enumerate(work):
                past = self._pasts[w.slot]
                assert past is not None
                buf[b, :, longest - w.pos :, :] = past[layer][0]
            padded.append(buf)
        for b, w in enumerate(work):
            mask[b, longest - w.pos :] = 1
        ids = np.asarray([[w.token_ids[0]] for w in work], dtype=np.int64)
        pos = np.asarray([[w.pos] for w in work], dtype=np.int64)
        logits, present = self._run(ids, mask, pos, padded)
        out: dict[int, np.ndarray] = {}
        for b, w in enumerate(work):
            pad = longest - w.pos
            self._pasts[w.slot] = [np.ascontiguousarray(p[b : b + 1, :, pad:, :]) for p in present]
            out[w.slot] = logits[b, -1]
        return out

    def release(self, slot: int) -> None:
        self._pasts[slot] = None

    def truncate(self, slot: int, keep: int) -> int:
        past = self._pasts[slot]
        if past is None or keep <= 0:
            self._pasts[slot] = None
            return 0
        keep = min(keep, int(past[0].shape[2]))
        self._pasts[slot] = [np.ascontiguousarray(p[:, :, :keep, :]) for p in past]
        return keep

    def copy(self, src: int, dst: int) -> None:
        self._pasts[dst] = self._pasts[src]  # never written in place: each step makes new

    def slot_length(self, slot: int) -> int:
        past = self._pasts[slot]
        return 0 if past is None else int(past[0].shape[2])

    def close(self) -> None:
        self._pasts = [None] * len(self._pasts)
