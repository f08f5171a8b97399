from __future__ import annotations

from cbserve.scheduler import CacheConfig, KVCacheManager


def make(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    config = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching)
    return KVCacheManager(config)


def compute(kv: KVCacheManager, seq_id: str, tokens: list[int], extra: tuple = ()) -> list[int]:
    """Admit a sequence (with prefix hits), 'compute' all its tokens but the last, cache its blocks."""
    hits = kv.get_computed_blocks(tokens, extra)
    num_cached = len(hits[0]) * kv.block_size
    assert kv.allocate_slots(seq_id, num_cached, len(tokens) - num_cached, hits) is not None
    kv.cache_full_blocks(seq_id, tokens, len(tokens), extra)
    kv.check_integrity()
    return kv.block_ids(seq_id)


def test_allocate_slots_exact_ids_and_out_of_blocks() -> None:
    kv = make(num_blocks=4)
    assert kv.allocate_slots("a", 0, 5) == [0, 1]
    assert kv.allocate_slots("a", 5, 3) == []  # fits in block 1
    assert kv.allocate_slots("a", 8, 1) == [2]
    assert kv.allocate_slots("b", 0, 9) is None  # needs 3, only 1 free: nothing changes
    assert "b" not in kv.tables and kv.num_free_blocks == 1
    assert kv.usage == 0.75
    kv.free("a")
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_prefix_hit_shares_full_blocks_only() -> None:
    kv = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert compute(kv, "a", prompt) == [0, 1, 2]
    blocks, hashes = kv.get_computed_blocks(prompt + [42])
    assert [b.block_id for b in blocks] == [0, 1] and len(hashes) == 2
    assert compute(kv, "b", prompt + [42]) == [0, 1, 3]
    assert kv.pool.blocks[0].ref_cnt == 2 and kv.pool.blocks[2].ref_cnt == 1


def test_last_prompt_token_never_served_from_cache() -> None:
    kv = make()
    prompt = list(range(8))  # exactly 2 blocks
    compute(kv, "a", prompt)
    blocks, _ = kv.get_computed_blocks(prompt)
    assert [b.block_id for b in blocks] == [0]  # the second block holds the last token: recompute it
    blocks, _ = kv.get_computed_blocks(prompt + [1])
    assert [b.block_id for b in blocks] == [0, 1]


def test_prefix_miss_on_different_tokens_and_chain() -> None:
    kv = make()
    compute(kv, "a", list(range(9)))
    assert kv.get_computed_blocks([0, 1, 2, 9, 4, 5, 6, 7, 8])[0] == []
    # same second block, different first block: the chained hash misses
    assert kv.get_computed_blocks([9, 9, 9, 9, 4, 5, 6, 7, 8])[0] == []


def test_cache_salt_isolates() -> None:
    kv = make()
    prompt = list(range(9))
    compute(kv, "a", prompt, extra=("tenant-1",))
    assert kv.get_computed_blocks(prompt)[0] == []
    assert kv.get_computed_blocks(prompt, ("tenant-2",))[0] == []
    assert len(kv.get_computed_blocks(prompt, ("tenant-1",))[0]) == 2


def test_freed_cached_blocks_hit_until_evicted_lru() -> None:
    kv = make(num_blocks=4)
    prompt = list(range(13))  # blocks 0,1,2 full + block 3 partial
    assert compute(kv, "a", prompt) == [0, 1, 2, 3]
    kv.free("a")  # queue (tail first): 3, 2, 1, 0
    assert [b.block_id for b in kv.pool.free_queue] == [3, 2, 1, 0]
    blocks, _ = kv.get_computed_blocks(prompt)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    # a 2-block request evicts block 3 (uncached) then block 2 (the prefix's last full block)
    assert kv.allocate_slots("b", 0, 5) == [3, 2]
    blocks, _ = kv.get_computed_blocks(prompt)
    assert [b.block_id for b in blocks] == [0, 1]
    # the hit revives free cached blocks 0 and 1 from the queue
    hits = kv.get_computed_blocks(prompt)
    assert kv.num_blocks_to_allocate("c", 8, 5, hits) == 2 + 2
    assert kv.allocate_slots("c", 8, 5, hits) is None  # 2 free blocks, needs 2 revived + 2 new
    assert kv.allocate_slots("c", 8, 1, hits) is None  # 2 revived + 1 new > 2
    kv.free("b")
    assert kv.allocate_slots("c", 8, 5, hits) == [2, 3]
    assert kv.block_ids("c") == [0, 1, 2, 3]
    kv.check_integrity()


def test_fork_and_copy_on_write_exact_copies() -> None:
    kv = make(num_blocks=8)
    prompt = list(range(6))  # block 0 full, block 1 holds 2 tokens
    assert compute(kv, "p", prompt) == [0, 1]
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert kv.pool.blocks[1].ref_cnt == 3 and kv.block_ids("c1") == [0, 1]
    assert kv.needs_copy_on_write("c1", 6)
    assert kv.num_blocks_to_allocate("c1", 6, 1) == 1
    assert kv.allocate_slots("c1", 6, 1) == []
    assert kv.take_block_copies() == [(1, 2)] and kv.block_ids("c1") == [0, 2]
    assert kv.copy_on_write("c2", 1)
    assert kv.take_block_copies() == [(1, 3)] and kv.block_ids("c2") == [0, 3]
    assert kv.pool.blocks[1].ref_cnt == 1 and not kv.needs_copy_on_write("p", 6)
    assert kv.allocate_slots("p", 6, 1) == [] and kv.take_block_copies() == []
    kv.check_integrity()
    for s in ("p", "c1", "c2"):
        kv.free(s)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    kv = make(num_blocks=8)
    compute(kv, "p", list(range(8)))
    kv.fork("p", "c")
    assert not kv.needs_copy_on_write("c", 8)
    assert kv.allocate_slots("c", 8, 1) == [2]
    assert kv.take_block_copies() == []


def test_caching_disabled() -> None:
    kv = make(caching=False)
    compute(kv, "a", list(range(9)))
    assert kv.get_computed_blocks(list(range(9)))[0] == []
    assert not kv.pool.cached
