"""The block pool: fixed-size KV blocks, reference counts, prefix-cache hashes, LRU eviction.

Design (vLLM v1 ``BlockPool``):

- Every block has a ``ref_cnt``. A block with ``ref_cnt == 0`` sits in the free queue,
  ordered by when it became free (oldest first); allocation pops from the front.
- A full block may carry a ``block_hash`` that chains the hash of the block before it
  with its own token ids, so equal hashes mean equal prefixes. Hashed blocks stay findable
  in ``cached_blocks`` after they are freed: a later request with the same prefix
  ``touch``es them back out of the free queue. When a cached free block reaches the
  front of the queue and is allocated, its hash is evicted (LRU eviction of cached blocks).
- A request frees its blocks tail first, so the blocks least likely to be shared (the end
  of a sequence) are evicted before the shared prefix blocks.
- The disaggregated decode side needs nothing special here: it allocates blocks for a
  remote prefill like any other and registers their hashes once the K/V has arrived
  (``KVCacheManager.register_computed``).

Hashes are a SHA-256 chain: a block's hash is the digest of its parent's hash and its own
token ids (little-endian int32), and the first block's parent is the digest of the
request's ``cache_salt``. A cache hit trusts the hash alone, so it must not collide: with
Python's 64-bit ``hash`` a tenant could craft a prompt whose blocks collide with another
tenant's and read their K/V (vLLM's advisory GHSA-rm76-4mrf-v9r8 moved to SHA-256 for the
same reason). The salt partitions the cache: requests share blocks only when their salts
(the gateway sets one per tenant) and their whole prefixes are equal. The digests are the
same in every process, so a prefill and a decode process agree on them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes  # 32-byte SHA-256 digest


def root_hash(cache_salt: str = "") -> BlockHash:
    """The parent of a request's first block: the cache partition its salt names."""
    return hashlib.sha256(b"hybridllm-prefix-cache-v1\0" + cache_salt.encode()).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()  # the same bytes on every machine
    return hashlib.sha256(parent_hash + tokens).digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, cache_salt: str = ""
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes: list[BlockHash] = []
    parent = root_hash(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, oldest-freed first. OrderedDict: O(1) remove from the middle.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pops ``num_blocks`` from the front of the free queue; the caller checked it fits."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"need {num_blocks} blocks, {len(self.free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_blocks.get(block.block_hash) is block:
            del self.cached_blocks[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def drop_hashes(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the blocks' prefix-cache entries (their K/V may be wrong): no hit finds them."""
        for block in blocks:
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Registers a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the free queue in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
