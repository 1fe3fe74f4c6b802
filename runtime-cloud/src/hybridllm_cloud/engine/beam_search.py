"""Beam search over the paged KV cache: one request, W beams, blocks shared by reference.

A beam-search request is one ``Request`` for the scheduler (admitted, preempted and freed
as a whole) that carries a ``BeamGroup``. It lives in two phases:

- **trunk**: the prompt is prefilled like any request (chunked, with its prefix-cache
  hits) into the request's own block table. The chunk that reaches the end of the prompt
  asks the runner, instead of a sampled token, for the ``keep`` best log-probabilities of
  the next token (``row_params``); the first beam step turns them into W beams.
- **beams**: every running beam is a row of the batch (id ``<request>#<beam>``) with its
  own block table. Tables are built by reference: a beam chosen by k children is handed to
  the first child as is and to the others as a copy of the *list* with one more reference
  on every block (``BlockPool.touch``), so the prompt and every common prefix exist once.
  Before a beam writes into a block that another beam still references (the last, partial
  block after a split), it gets a private copy of that block only (copy on write: one new
  block and a ``(src, dst)`` pair in ``SchedulerOutput.block_copies`` that the runner copies
  before the step's forward pass). A beam that is not chosen releases its table.

The selection is HF transformers' vectorised ``_beam_search`` (transformers >= 4.50) for a
batch of one, op for op in float32, so the output is token-identical to
``model.generate(num_beams=W, do_sample=False, length_penalty=..., early_stopping=...)``
when the logits are: the ``keep = max(2, 1 + #eos) * W`` best continuations over all beams
(per-row top-``keep`` log-probabilities are enough, since a global top-``keep`` entry is in
its row's top ``keep``), running beams are the best W of them that did not just finish,
the best W of those that finished among the first W candidates join the finished set with
the length penalty, and the search ends with HF's early-stop heuristic,
``early_stopping`` (``True``, ``False`` or ``"never"``) and the length limit.

After a preemption (by recompute) the generated tokens and scores are kept: the prompt
and the beams' common prefix are prefilled again as the trunk (the request's output
tokens are set to that prefix), without a beam step at its end, then every beam is forked
from it and recomputes the rest of its own tokens (chunked when the token budget is
short), and the next step selects exactly as it would have. Below the common prefix the
recompute does not rebuild the sharing (each beam holds its own blocks until the next
split), so a request is refused when W full, unshared tables would not fit in the cache
(``worst_case_blocks``): a preempted group then always fits again once alone.

``share_kv=False`` is the copy-per-beam baseline for the benchmark: a beam copies every
block it shares on its first write after a split, as an engine without shared KV would.
"""

from __future__ import annotations

import torch

from hybridllm_cloud.engine import block_pool
from hybridllm_cloud.outputs import BeamKVStats, BeamSequence, ScheduledRequest, TokenLogprobs
from hybridllm_cloud.sampling_params import SamplingParams

NEG = -1.0e9  # HF's "impossible" score


class BeamGroup:
    def __init__(
        self,
        params: SamplingParams,
        prompt_len: int,
        stop_token_ids: tuple[int, ...],
        max_new_tokens: int,
        share_kv: bool = True,
    ) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.num_return = params.num_return_sequences
        self.stop_token_ids = frozenset(stop_token_ids)
        self.prompt_len = prompt_len
        self.max_new = max_new_tokens
        self.share_kv = share_kv
        self.keep = max(2, 1 + len(self.stop_token_ids)) * self.width
        self.row_params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0, logprobs=self.keep, ignore_eos=True
        )
        self.user_stop_ids = frozenset(params.stop_token_ids)
        # Search state, as in HF (batch of one).
        self.running: list[list[int]] = []  # generated tokens of each running beam
        self.running_scores = torch.zeros(self.width, dtype=torch.float32)
        self.running_scores[1:] = NEG
        self.finished: list[list[int]] = [[] for _ in range(self.width)]
        self.finished_scores = torch.full((self.width,), NEG, dtype=torch.float32)
        self.is_finished = torch.zeros(self.width, dtype=torch.bool)
        self.heuristic_unsatisfied = True
        self.cur_len = prompt_len
        self.done = False
        # KV: one block table per running beam once forked (None: not forked, or preempted).
        self.tables: list[list[block_pool.KVBlock]] | None = None
        self.computed: list[int] = []  # tokens of each beam whose K/V are in its table
        self.stats = BeamKVStats()

    # --- phases -----------------------------------------------------------------------------

    @property
    def has_beams(self) -> bool:
        return bool(self.running)

    def tokens(self, beam: int) -> list[int]:
        return self.running[beam]

    @property
    def seq_len(self) -> int:
        """Prompt + generated tokens of every running beam (all have the same length)."""
        return self.prompt_len + (len(self.running[0]) if self.running else 0)

    def fork(
        self, trunk: list[block_pool.KVBlock], trunk_len: int, pool: block_pool.BlockPool
    ) -> None:
        """Every running beam starts from the prefilled trunk (prompt + common prefix)."""
        self.tables = [trunk]
        self.computed = [trunk_len]
        self._reorder([0] * len(self.running), pool)

    def common_prefix(self) -> list[int]:
        """The generated tokens every running beam shares: recomputed once after preemption."""
        if not self.running:
            return []
        first = self.running[0]
        n = len(first)
        for tokens in self.running[1:]:
            split = (i for i, (a, b) in enumerate(zip(first, tokens, strict=True)) if a != b)
            n = min(n, next(split, n))
        return first[:n]

    def worst_case_blocks(self, block_size: int) -> int:
        """Blocks of W unshared tables of full length: what a recompute may need at most."""
        return self.width * -(-(self.prompt_len + self.max_new) // block_size)

    def release(self, pool: block_pool.BlockPool) -> None:
        """Gives every beam's blocks back (finish, abort, preemption), tail first."""
        for table in self.tables or ():
            pool.free_blocks(reversed(table))
        self.tables = None
        self.computed = []

    def _reorder(self, parents: list[int], pool: block_pool.BlockPool) -> None:
        """New beam j continues old beam ``parents[j]``: tables by reference, unchosen freed."""
        assert self.tables is not None
        chosen = set(parents)
        for old, table in enumerate(self.tables):
            if old not in chosen:
                pool.free_blocks(reversed(table))
        taken: set[int] = set()
        tables: list[list[block_pool.KVBlock]] = []
        for parent in parents:
            table = self.tables[parent]
            if parent in taken:
                table = list(table)
                pool.touch(table)
            taken.add(parent)
            tables.append(table)
        self.computed = [self.computed[p] for p in parents]
        self.tables = tables

    # --- KV for one step ----------------------------------------------------------------------

    def plan(self, budget: int, chunked: bool) -> list[int] | None:
        """Tokens each beam computes this step; None when they do not fit in ``budget``.

        All pending tokens when they fit (the step then selects); otherwise, with chunked
        prefill, each beam's pending tokens but its last (a recompute after preemption),
        since the selection needs every beam's last logits in the same step.
        """
        pending = [self.seq_len - c for c in self.computed]
        if sum(pending) <= budget:
            return pending
        if not chunked:
            return None
        plan: list[int] = []
        for p in pending:
            n = min(max(p - 1, 0), budget)
            plan.append(n)
            budget -= n
        return plan if any(plan) else None

    def _cow_range(self, computed: int, block_size: int) -> int:
        return computed // block_size if self.share_kv else 0

    def blocks_needed(self, plan: list[int], block_size: int) -> int:
        """New blocks ``allocate`` will take: growth plus copies of shared blocks written."""
        assert self.tables is not None
        need = 0
        dropped: dict[int, int] = {}  # block id -> references already given up this step
        for table, computed, n in zip(self.tables, self.computed, plan, strict=True):
            if n == 0:
                continue
            for block in table[self._cow_range(computed, block_size) :]:
                if block.ref_cnt - dropped.get(block.block_id, 0) > 1:
                    need += 1
                    dropped[block.block_id] = dropped.get(block.block_id, 0) + 1
            need += max(0, -(-(computed + n) // block_size) - len(table))
        return need

    def allocate(
        self, plan: list[int], pool: block_pool.BlockPool, block_size: int
    ) -> list[tuple[int, int]]:
        """Copies on write and grows each table; returns the ``(src, dst)`` block copies."""
        assert self.tables is not None
        copies: list[tuple[int, int]] = []
        for table, computed, n in zip(self.tables, self.computed, plan, strict=True):
            if n == 0:
                continue
            for i in range(self._cow_range(computed, block_size), len(table)):
                block = table[i]
                if block.ref_cnt > 1:
                    (fresh,) = pool.get_new_blocks(1)
                    copies.append((block.block_id, fresh.block_id))
                    pool.free_blocks([block])
                    table[i] = fresh
            grow = -(-(computed + n) // block_size) - len(table)
            if grow > 0:
                table.extend(pool.get_new_blocks(grow))
        self.stats.num_block_copies += len(copies)
        distinct = len({b.block_id for t in self.tables for b in t})
        self.stats.peak_blocks = max(self.stats.peak_blocks, distinct)
        self.stats.peak_blocks_copy_per_beam = max(
            self.stats.peak_blocks_copy_per_beam, sum(len(t) for t in self.tables)
        )
        return copies

    def records(
        self, request_id: str, prompt: list[int], plan: list[int]
    ) -> list[tuple[int, ScheduledRequest]]:
        """``(beam index, row)`` for every beam with tokens to compute this step."""
        assert self.tables is not None
        out: list[tuple[int, ScheduledRequest]] = []
        sample = all(c + n == self.seq_len for c, n in zip(self.computed, plan, strict=True))
        for beam, (table, computed, n) in enumerate(
            zip(self.tables, self.computed, plan, strict=True)
        ):
            if n == 0:
                continue
            seq = prompt + self.running[beam]
            out.append(
                (
                    beam,
                    ScheduledRequest(
                        request_id=row_id(request_id, beam),
                        token_ids=seq[computed : computed + n],
                        start_position=computed,
                        block_ids=[b.block_id for b in table],
                        sample=sample,
                        sampling_params=self.row_params,
                        num_output_tokens=len(self.running[beam]),
                    ),
                )
            )
        return out

    def advance(self, beam: int, num_tokens: int) -> None:
        self.computed[beam] += num_tokens

    # --- selection (HF's _beam_search, batch of one) ------------------------------------------

    def step(self, rows: list[TokenLogprobs], pool: block_pool.BlockPool) -> None:
        """One selection from each running beam's top-``keep`` next-token log-probabilities.

        ``rows`` has one entry per running beam (one, the trunk's, before the first step).
        """
        width, keep = self.width, self.keep
        if not self.running:
            rows = rows * width  # HF runs W copies of the prompt; beams 1.. start at -1e9
        ids = torch.tensor([r.top_token_ids[:keep] for r in rows], dtype=torch.int64)
        logprobs = torch.tensor([r.top_logprobs[:keep] for r in rows], dtype=torch.float32)
        scores = (logprobs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(scores, k=keep)
        parents = (top_index // keep).tolist()
        tokens = ids.reshape(-1)[top_index].tolist()
        generated = self.cur_len + 1 - self.prompt_len
        base = self.running if self.running else [[] for _ in range(width)]
        seqs = [base[p] + [t] for p, t in zip(parents, tokens, strict=True)]
        hits = torch.tensor(
            [t in self.stop_token_ids or generated >= self.max_new for t in tokens],
            dtype=torch.bool,
        )
        # e. the best W that did not just finish continue
        running_scores = top_scores + hits.to(torch.float32) * NEG
        next_index = torch.topk(running_scores, k=width)[1]
        # f. the best W that finished among the first W candidates join the finished set
        top_mask = torch.zeros(keep, dtype=torch.bool)
        top_mask[:width] = True
        just_finished = hits & top_mask
        fin_scores = top_scores / (generated**self.length_penalty)
        full = bool(self.is_finished.all()) and self.early_stopping is True
        fin_scores = fin_scores + float(full) * NEG
        fin_scores = fin_scores + float(not self.heuristic_unsatisfied) * NEG
        fin_scores = fin_scores + (~just_finished) * NEG
        merged_scores = torch.cat((self.finished_scores, fin_scores))
        merged_seqs = self.finished + seqs
        merged_finished = torch.cat((self.is_finished, just_finished))
        best = torch.topk(merged_scores, k=width)[1]
        self.finished = [merged_seqs[i] for i in best.tolist()]
        self.finished_scores = merged_scores[best]
        self.is_finished = merged_finished[best]
        # g. the next iteration: running beams, their tables, the stop conditions
        new_parents = [parents[i] for i in next_index.tolist()]
        self.running = [seqs[i] for i in next_index.tolist()]
        self.running_scores = running_scores[next_index]
        self.cur_len += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new
        else:
            best_len = self.cur_len - self.prompt_len
        best_running = self.running_scores[:1] / (best_len**self.length_penalty)
        worst_finished = torch.where(
            self.is_finished, torch.min(self.finished_scores), torch.tensor(NEG)
        )
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and bool(
            torch.any(best_running > worst_finished)
        )
        open_beam = not (bool(self.is_finished.all()) and self.early_stopping is True)
        valid = not bool(hits.all())
        self.done = not (self.heuristic_unsatisfied and open_beam and valid)
        if not self.done and self.tables is not None:  # else forked when first scheduled
            self._reorder(new_parents, pool)

    def results(self) -> list[BeamSequence]:
        out: list[BeamSequence] = []
        for tokens, score in zip(
            self.finished[: self.num_return],
            self.finished_scores[: self.num_return].tolist(),
            strict=True,
        ):
            last = tokens[-1] if tokens else None
            if last is not None and last in self.stop_token_ids:
                stop_reason = last if last in self.user_stop_ids else None
                out.append(BeamSequence(list(tokens), score, "stop", stop_reason))
            else:
                out.append(BeamSequence(list(tokens), score, "length"))
        return out


def row_id(request_id: str, beam: int) -> str:
    """The batch row of one beam (the runner and the results see beams by this id)."""
    return f"{request_id}#beam{beam}"
