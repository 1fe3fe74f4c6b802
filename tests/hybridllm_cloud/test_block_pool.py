"""BlockPool and KVCacheManager on tiny real objects, exact block ids and eviction order."""

from __future__ import annotations

import pytest

from hybridllm_cloud.engine import block_pool, kv_cache_manager
from hybridllm_cloud.engine.request import Request, RequestStatus
from hybridllm_cloud.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8))


def make_manager(num_blocks: int = 10, block_size: int = 4, caching: bool = True):
    pool = block_pool.BlockPool(num_blocks, enable_caching=caching)
    return pool, kv_cache_manager.KVCacheManager(pool, block_size)


def test_hash_chain_depends_on_parent() -> None:
    a = block_pool.hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_pool.hash_request_blocks([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2
    assert len(b) == 2
    assert a[1] != b[1]  # same second block, different prefix
    assert a == block_pool.hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)


def test_hashes_are_sha256_chained_from_the_salt() -> None:
    import hashlib

    import numpy as np

    a = block_pool.hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    root = hashlib.sha256(b"hybridllm-prefix-cache-v1\0").digest()
    first = hashlib.sha256(root + np.asarray([1, 2, 3, 4], "<i4").tobytes()).digest()
    assert a[0] == first
    assert a[1] == hashlib.sha256(first + np.asarray([5, 6, 7, 8], "<i4").tobytes()).digest()
    salted = block_pool.hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-b")
    assert not set(a) & set(salted)
    # Python's hash of a tuple collides where the chain must not: hash(-1) == hash(-2).
    assert block_pool.hash_request_blocks([-1], 1) != block_pool.hash_request_blocks([-2], 1)


def test_prefix_blocks_are_shared_only_within_one_salt() -> None:
    _pool, kv = make_manager()
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8, cache_salt="tenant-a"))
    kv.allocate(a, 10, [])
    other = Request("b", list(range(10)), SamplingParams(max_tokens=8, cache_salt="tenant-b"))
    assert kv.get_computed_blocks(other) == ([], 0)
    same = Request("c", list(range(10)), SamplingParams(max_tokens=8, cache_salt="tenant-a"))
    blocks, hit = kv.get_computed_blocks(same)
    assert [b.block_id for b in blocks] == [0, 1]
    assert hit == 8


def test_allocate_takes_blocks_from_front_of_free_queue() -> None:
    pool, kv = make_manager()
    req = make_request("a", list(range(10)))  # 3 blocks: 4 + 4 + 2
    blocks, hit = kv.get_computed_blocks(req)
    assert (blocks, hit) == ([], 0)
    assert kv.can_allocate(req, 10, blocks)
    new = kv.allocate(req, 10, blocks)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert [b.ref_cnt for b in new] == [1, 1, 1]
    assert pool.num_free_blocks == 7
    # the two full blocks are cached, the partial one is not
    assert new[0].block_hash is not None
    assert new[1].block_hash is not None
    assert new[2].block_hash is None
    assert len(pool.cached_blocks) == 2


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    pool, kv = make_manager()
    a = make_request("a", list(range(10)))
    kv.allocate(a, 10, [])
    b = make_request("b", [*range(8), 99, 98, 97])
    blocks, hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1]
    assert hit == 8
    new = kv.allocate(b, b.num_tokens - hit, blocks)
    assert b.num_computed_tokens == 8
    assert [blk.block_id for blk in new] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert kv.prefix_hit_rate() == pytest.approx(8 / 21)


def test_fully_cached_prompt_leaves_last_block_to_compute() -> None:
    _, kv = make_manager()
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8, [])
    b = make_request("b", list(range(8)))
    blocks, hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0]
    assert hit == 4


def test_free_is_tail_first_and_lru_evicts_oldest_cached() -> None:
    pool, kv = make_manager(num_blocks=4)
    a = make_request("a", list(range(12)))  # blocks 0,1,2 all full and cached
    kv.allocate(a, 12, [])
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert list(pool.free_queue) == [3, 2, 1, 0]
    assert len(pool.cached_blocks) == 3
    # a new unrelated request takes block 3 (uncached) then 2 (evicts a's last block)
    b = make_request("b", [50, 51, 52, 53, 54])
    new = kv.allocate(b, 5, [])
    assert [blk.block_id for blk in new] == [3, 2]
    assert pool.num_evictions == 1
    # a's first two blocks are still a hit
    c = make_request("c", [*range(8), 7, 7])
    blocks, hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [0, 1]
    assert hit == 8


def test_touching_cached_free_block_removes_it_from_free_queue() -> None:
    pool, kv = make_manager(num_blocks=4)
    a = make_request("a", list(range(5)))
    kv.allocate(a, 5, [])
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = make_request("b", [0, 1, 2, 3, 9, 9])
    blocks, _ = kv.get_computed_blocks(b)
    assert kv.can_allocate(b, 2, blocks)
    kv.allocate(b, 2, blocks)
    assert kv.block_ids("b") == [0, 2]
    assert list(pool.free_queue) == [3, 1]


def test_can_allocate_counts_free_prefix_blocks() -> None:
    _, kv = make_manager(num_blocks=3)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8, [])
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)  # blocks 0, 1 cached and free; 3 free in all
    b = make_request("b", [*range(8), 1, 2, 3, 4, 5, 6, 7, 8, 9])  # 17 tokens: 5 blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8
    assert not kv.can_allocate(b, 9, blocks)  # needs 2 prefix + 3 new > 3
    assert kv.can_allocate(b, 4, blocks)  # 2 prefix + 1 new


def test_append_slot_grows_at_block_boundary_and_refuses_when_full() -> None:
    pool, kv = make_manager(num_blocks=2)
    a = make_request("a", list(range(4)))
    kv.allocate(a, 4, [])
    a.num_computed_tokens = 4
    a.output_token_ids.append(7)
    assert kv.append_slot(a, 1)
    assert kv.block_ids("a") == [0, 1]
    a.num_computed_tokens = 5
    for t in (8, 9, 10):
        a.output_token_ids.append(t)
        assert kv.append_slot(a, 1)
        a.num_computed_tokens += 1
    a.output_token_ids.append(11)
    assert not kv.append_slot(a, 1)  # 9th token needs a third block
    assert pool.num_free_blocks == 0


def test_caching_off_never_hits() -> None:
    pool, kv = make_manager(caching=False)
    kv.allocate(make_request("a", list(range(8))), 8, [])
    assert pool.cached_blocks == {}
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_double_free_is_an_error() -> None:
    pool = block_pool.BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([blk])
