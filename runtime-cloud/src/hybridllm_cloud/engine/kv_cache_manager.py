"""Per-request block tables on top of the block pool.

A request owns its block table (``req_to_blocks``). Allocation answers before it acts:
``can_allocate`` / ``allocate`` for a request entering the running set (with the prefix
blocks found by ``get_computed_blocks``), ``append_slot`` for a running request that needs
room for its next tokens, which returns False when the pool is exhausted so the scheduler
can preempt. Full blocks are hashed and registered in the prefix cache as soon as the
tokens that fill them are scheduled: the model runner writes every scheduled token's K/V
before any attention of the same layer reads it, so a block is safe to share from the
step in which it is computed (vLLM v1 does the same). Blocks that a prefill worker
fills (``allocate(..., register=False)``) are registered only once their K/V have arrived
(``register_computed``), so no other request can read a block that is still in flight.
"""

from __future__ import annotations

from hybridllm_cloud.engine import block_pool
from hybridllm_cloud.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: block_pool.BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[block_pool.KVBlock]] = {}
        self.req_to_block_hashes: dict[str, list[block_pool.BlockHash]] = {}
        self.req_to_num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[block_pool.BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        while len(hashes) < num_full:
            start = len(hashes) * self.block_size
            tokens = request.token_slice(start, start + self.block_size)
            parent = (
                hashes[-1] if hashes else block_pool.root_hash(request.sampling_params.cache_salt)
            )
            hashes.append(block_pool.hash_block_tokens(parent, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[block_pool.KVBlock], int]:
        """The longest cached prefix: its blocks and its length in tokens.

        At least one token is always left to compute (the model must produce logits for the
        last position), so a fully cached prompt reuses all but its last block. With prompt
        logprobs the hit stops before ``prompt_logprobs_start - 1``, whose logits are needed.
        """
        if not self.pool.enable_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        params = request.sampling_params
        if params.prompt_logprobs is not None and not request.output_token_ids:
            # not yet delivered: logits from position start - 1 on are needed
            max_blocks = min(max_blocks, (params.prompt_logprobs_start - 1) // self.block_size)
        blocks: list[block_pool.KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, num_computed_blocks: int = 0
    ) -> int:
        have = len(self.req_to_blocks.get(request.request_id, ())) + num_computed_blocks
        computed = request.num_computed_tokens + num_computed_blocks * self.block_size
        return max(0, self.num_blocks_for(computed + num_new_tokens) - have)

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[block_pool.KVBlock],
        watermark_blocks: int = 0,
    ) -> bool:
        need = self._num_new_blocks(request, num_new_tokens, len(computed_blocks))
        # Computed blocks that are free now leave the free queue when touched.
        need += sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return need + watermark_blocks <= self.pool.num_free_blocks

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[block_pool.KVBlock],
        register: bool = True,
    ) -> list[block_pool.KVBlock]:
        """Takes the prefix blocks and new blocks for ``num_new_tokens``; returns the new ones.

        ``register=False``: the new blocks are filled from elsewhere; their hashes are
        registered by ``register_computed`` once they are.
        """
        if request.request_id in self.req_to_blocks:
            raise ValueError(f"request {request.request_id} already holds blocks")
        self.pool.touch(computed_blocks)
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += len(computed_blocks) * self.block_size
        request.num_computed_tokens = len(computed_blocks) * self.block_size
        self.req_to_blocks[request.request_id] = list(computed_blocks)
        self.req_to_num_cached_blocks[request.request_id] = len(computed_blocks)
        return self._grow(request, num_new_tokens, register)

    def append_slot(self, request: Request, num_new_tokens: int = 1) -> bool:
        """Room for ``num_new_tokens`` more tokens of a running request; False if none."""
        need = self._num_new_blocks(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        self._grow(request, num_new_tokens)
        return True

    def _grow(
        self, request: Request, num_new_tokens: int, register: bool = True
    ) -> list[block_pool.KVBlock]:
        need = self._num_new_blocks(request, num_new_tokens)
        new_blocks = self.pool.get_new_blocks(need)
        self.req_to_blocks[request.request_id].extend(new_blocks)
        if register:
            self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def register_computed(self, request: Request) -> None:
        """Registers the full blocks of the request's computed tokens in the prefix cache."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        blocks = self.req_to_blocks[request.request_id]
        hashes = self._block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes))
        start = self.req_to_num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.req_to_num_cached_blocks[request.request_id] = max(start, num_full)

    def trim(self, request: Request) -> int:
        """Gives back the blocks beyond the request's computed tokens (speculative
        decoding: blocks taken for proposals that were rejected), tail first; returns how
        many. They were never registered in the prefix cache (only blocks full of real
        tokens are), so freeing them loses nothing."""
        blocks = self.req_to_blocks[request.request_id]
        keep = self.num_blocks_for(request.num_computed_tokens)
        extra = blocks[keep:]
        if extra:
            del blocks[keep:]
            self.pool.free_blocks(reversed(extra))
        return len(extra)

    def free(self, request: Request, drop_cached: bool = False) -> None:
        """Releases the request's blocks, tail first (see block_pool).

        ``drop_cached``: the blocks' K/V may be half-written (a failed step), so their
        prefix-cache entries go too.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if drop_cached:
            self.pool.drop_hashes(blocks)
        self.pool.free_blocks(reversed(blocks))
        if request.beam_group is not None:  # its beams' tables (beam blocks carry no hashes)
            request.beam_group.release(self.pool)
        self.req_to_num_cached_blocks.pop(request.request_id, None)
        if request.status.is_finished:
            self.req_to_block_hashes.pop(request.request_id, None)

    def take_blocks(self, request: Request) -> list[block_pool.KVBlock]:
        """Hands the request's table (its references) to the caller: beam search forks it."""
        blocks = self.req_to_blocks[request.request_id]
        self.req_to_blocks[request.request_id] = []
        return blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
