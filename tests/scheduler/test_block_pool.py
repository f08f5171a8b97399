from __future__ import annotations

import pytest

from cbserve.scheduler.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_o1_remove_from_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert q.popleft() is blocks[0]
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_from_head_and_free_to_tail() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert ids(a) == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(0.5)
    pool.free(reversed(a))  # a request's blocks go back tail first
    assert queue_ids(pool) == [3, 4, 5, 2, 1, 0]
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate(7)


def test_lru_eviction_of_cached_free_blocks() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    for i, b in enumerate(a):
        key = (None if i == 0 else hash((None, (i - 1,), ())), (i,), ())
        pool.cache_block(b, hash(key), key)
    pool.free(reversed(a))  # queue: 2, 3, 1, 0 -> block 1 (later block of the prefix) evicted first
    assert queue_ids(pool) == [2, 3, 1, 0]
    assert len(pool.cached) == 2
    got = pool.allocate(3)
    assert ids(got) == [2, 3, 1]
    assert got[2].block_hash is None and len(pool.cached) == 1 and pool.num_evictions == 1
    assert a[0].block_hash is not None  # the prefix's first block survives
    pool.check_integrity()


def test_touch_revives_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    key = (None, (1, 2), ())
    pool.cache_block(b, hash(key), key)
    pool.free([b])
    assert queue_ids(pool) == [1, 2, 3, 0]
    hit = pool.get_cached_block(hash(key), key)
    assert hit is b
    pool.touch([hit])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [1, 2, 3]
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free([hit])
    pool.free([hit])
    assert queue_ids(pool) == [1, 2, 3, 0]
    pool.check_integrity()


def test_hit_confirmed_by_key_and_first_writer_wins() -> None:
    pool = BlockPool(3)
    b1, b2 = pool.allocate(2)
    key = (None, (1, 2), ())
    pool.cache_block(b1, hash(key), key)
    pool.cache_block(b2, hash(key), key)  # same content computed twice: keep the first
    assert pool.cached[hash(key)] is b1 and b2.block_hash is None
    assert pool.get_cached_block(hash(key), (None, (1, 3), ())) is None  # a hash collision is a miss


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    b.ref_cnt = 0  # leaked: not in the free queue but no references
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    key = (None, (1,), ())
    pool.cache_block(b, hash(key), key)
    assert not pool.reset_prefix_cache()
    pool.free([b])
    assert pool.reset_prefix_cache() and not pool.cached and b.block_hash is None
