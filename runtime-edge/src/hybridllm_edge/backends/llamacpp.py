"""llama.cpp backend: N parallel slots decoded in one ``llama_batch``, as llama.cpp's server does.

One llama context holds the KV of ``parallel`` sequences (``n_seq_max``); each slot is a
sequence id. A step packs every slot's tokens into one batch, each token tagged with its
slot's sequence id and position, and asks for logits only where the engine will sample.
llama.cpp's attention mask keeps the sequences apart, so one ``llama_decode`` advances all
of them: the weights are read once per step for every running request, which is where the
throughput over a one-request-at-a-time server comes from. ``release`` removes a slot's
cells from the KV (``llama_memory_seq_rm``) so a cancelled request frees its memory at once.

The context is used only from the engine thread. The KV is split per sequence
(``kv_unified`` off), so every slot gets exactly ``max_model_len`` positions and one long
request cannot starve the others, and a token attends only to its own slot's cells.

Token order matters with a split KV. llama.cpp cuts such a batch into micro-batches with
``split_equal(sequential=true)``: one micro-batch holds the same number of tokens of each
of a run of *consecutive, increasing* sequence ids, taken in batch order. A step whose
slots come as 3, 0, 5, 1, 2, 4, 6, 7 therefore runs as three graph computations ({3, 4},
{0, 1, 2}, {5, 6, 7}) and 7, 6, ..., 0 as eight, each a full pass over the weights:
measured with 8 slots (``bench/edge/order.py``), 1.5x and 2.0x the time of the same
tokens in slot order on SmolLM2 Q4_1, 1.8x and 3.4x on F16. So ``forward`` packs the
batch in slot order, whatever order the engine lists the work in, and hands the logits
back in the engine's order.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals, _logger

from hybridllm_common import structured
from hybridllm_edge import config
from hybridllm_edge.backends.base import BackendInfo, SlotWork

log = logging.getLogger(__name__)


class LlamaCppBackend:
    def __init__(self, path: Path, revision: str, settings: config.EdgeSettings) -> None:
        # llama.cpp logs every graph build at debug level; keep its warnings and errors only.
        _logger.set_verbose(log.isEnabledFor(logging.DEBUG))
        threads = settings.threads or max(1, (os.cpu_count() or 2) // 2)
        model_params = llama_cpp.llama_model_default_params()
        self._model = _internals.LlamaModel(
            path_model=str(path), params=model_params, verbose=False
        )
        train_len = self._model.n_ctx_train()
        max_len = min(settings.max_model_len, train_len)
        if max_len < settings.max_model_len:
            log.warning(
                "max_model_len %d exceeds the model's training context %d; using %d",
                settings.max_model_len,
                train_len,
                max_len,
            )
        self.num_batch = settings.max_num_batched_tokens
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_len * settings.parallel
        params.n_batch = self.num_batch
        params.n_ubatch = self.num_batch
        params.n_seq_max = settings.parallel
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = False
        params.no_perf = True
        self._ctx = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        self._mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        self._batch = llama_cpp.llama_batch_init(self.num_batch, 0, 1)
        vocab = self._model.vocab
        self._vocab = vocab
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        per_seq = llama_cpp.llama_n_ctx_seq(self._ctx.ctx)
        eos = {
            t
            for t in (llama_cpp.llama_vocab_eos(vocab), llama_cpp.llama_vocab_eot(vocab))
            if t >= 0
        }
        eos |= {t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        meta = self._model.metadata()
        self._pieces = [self._piece(t) for t in range(n_vocab)]
        self.info = BackendInfo(
            name="llamacpp",
            model_path=str(path),
            revision=revision,
            vocab_size=n_vocab,
            max_model_len=min(max_len, per_seq),
            num_slots=settings.parallel,
            eos_token_ids=frozenset(eos),
            bos_token=self._text(llama_cpp.llama_vocab_bos(vocab)),
            eos_token=self._text(llama_cpp.llama_vocab_eos(vocab)),
            chat_template=meta.get("tokenizer.chat_template"),
            extra={"threads": str(threads), "add_bos": str(self._model.add_bos_token())},
        )
        self._lengths = [0] * settings.parallel

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, 64, 0, True)
        return bytes(buf.raw[: max(n, 0)])

    def _text(self, token: int) -> str:
        return self._piece(token).decode("utf-8", "replace") if token >= 0 else ""

    def grammar_vocabulary(self) -> structured.Vocabulary:
        """llama.cpp's own vocabulary and tokenizer (control tokens marked as special)."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        eos = sorted(self.info.eos_token_ids)
        tok = lltokenizer_from_vocab(self._vocab, n_vocab=self.info.vocab_size, eos_token=eos)
        return structured.Vocabulary(tok, self.info.vocab_size)

    def encode(self, text: str, add_special: bool) -> list[int]:
        add_bos = add_special and self._model.add_bos_token()
        return self._model.tokenize(text.encode("utf-8"), add_bos, True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    def forward(self, work: list[SlotWork]) -> np.ndarray:
        total = sum(len(item.token_ids) for item in work)
        if total > self.num_batch:  # before writing: the batch holds num_batch tokens
            raise ValueError(f"step of {total} tokens exceeds n_batch {self.num_batch}")
        batch = self._batch
        n = 0
        last_index = [0] * len(work)  # batch index of each item's last token
        for k in sorted(range(len(work)), key=lambda k: work[k].slot):  # see module docstring
            item = work[k]
            last = len(item.token_ids) - 1
            for i, token in enumerate(item.token_ids):
                batch.token[n] = token
                batch.pos[n] = item.pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = item.slot
                batch.logits[n] = item.want_logits and i == last
                n += 1
            last_index[k] = n - 1
        wanted = [last_index[k] for k, item in enumerate(work) if item.want_logits]
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self._ctx.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc} on a batch of {n} tokens")
        for item in work:
            self._lengths[item.slot] = item.pos + len(item.token_ids)
        vocab = self.info.vocab_size
        out = np.empty((len(wanted), vocab), dtype=np.float32)
        for row, idx in enumerate(wanted):
            ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, idx)
            out[row] = np.ctypeslib.as_array(ptr, shape=(vocab,))
        return out

    def release(self, slot: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._mem, slot, -1, -1)
        self._lengths[slot] = 0

    def truncate(self, slot: int, keep: int) -> int:
        if keep <= 0 or not llama_cpp.llama_memory_seq_rm(self._mem, slot, keep, -1):
            self.release(slot)  # a memory that cannot cut a sequence (recurrent) empties it
            return 0
        self._lengths[slot] = keep
        return keep

    def copy(self, src: int, dst: int) -> None:
        # Between the per-sequence streams of a split KV llama.cpp copies whole buffers
        # (at the next decode's update, before its compute): all of src, cut afterwards.
        llama_cpp.llama_memory_seq_rm(self._mem, dst, -1, -1)
        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self._lengths[dst] = self._lengths[src]

    def slot_length(self, slot: int) -> int:
        """Cells the KV holds for the slot, read from llama.cpp itself (not our bookkeeping)."""
        pos_max = llama_cpp.llama_memory_seq_pos_max(self._mem, slot)
        return 0 if pos_max < 0 else int(pos_max) + 1

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None  # type: ignore[assignment]
        self._ctx.close()
        self._model.close()
