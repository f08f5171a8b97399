"""Retention hints (scheduler/kv/retention.py, requests/retention.py): hinted free blocks are evicted only once
nothing else is free, lowest priority first; their time passed, they age like any other; the operator's share
bounds them; the tiers' index honours them too; and a flood of conversations without hints does not evict a
hinted prefix through the real engine, which refuses hints past the server's limits."""

from __future__ import annotations

import pytest
from sched_fakes import FakeClock, FakeExecutor

from cbserve.scheduler import CacheConfig, EngineConfig, EngineCore, EngineRequest, KVCacheManager, SamplingParams
from cbserve.scheduler.config import OffloadConfig, RetentionLimits, SchedulerConfig
from cbserve.scheduler.errors import RequestRejectedError
from cbserve.scheduler.kv.block_pool import BlockPool
from cbserve.scheduler.kv.offload import OffloadConnector
from cbserve.scheduler.requests.retention import Retention, block_retention, check_retention


def _cached(pool: BlockPool, n: int, start: int = 0) -> list:
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        key = (None, (start + i,), ())
        pool.cache_block(b, pool.key_hash(key), key)
    return blocks


def test_hinted_blocks_go_last_lowest_priority_first_and_age_when_their_time_passes() -> None:
    clock = FakeClock()
    pool = BlockPool(8, retention=RetentionLimits(max_fraction=0.5), clock=clock)
    blocks = _cached(pool, 4)
    pool.retain(blocks[0], 80, 10.0)
    pool.retain(blocks[1], 20, 10.0)
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and len(pool.retained) == 2
    pool.check_integrity()
    taken = pool.allocate(6)  # the 4 never-cached blocks, then the 2 unhinted cached ones
    assert {b.block_id for b in taken} == {2, 3, 4, 5, 6, 7} and blocks[0].block_hash is not None
    (low,) = pool.allocate(1)  # only hinted ones left: the lowest priority goes first (a hint is soft)
    assert low is blocks[1] and pool.num_retained_evictions == 1 and blocks[0].block_hash is not None
    pool.free([*taken, low])
    clock.advance(11.0)  # block 0's time passed: it rejoins the LRU queue at its head, the first to go
    (first,) = pool.allocate(1)
    assert first is blocks[0] and len(pool.retained) == 0 and pool.num_retained_evictions == 1
    pool.check_integrity()


def test_a_hit_keeps_the_hint_and_the_operators_share_bounds_the_hinted_blocks() -> None:
    clock = FakeClock()
    pool = BlockPool(8, retention=RetentionLimits(max_fraction=0.25), clock=clock)  # 2 blocks at most
    blocks = _cached(pool, 3)
    for b, prio in zip(blocks, (30, 60, 90), strict=True):
        pool.retain(b, prio, 100.0)
    pool.free(blocks)
    assert {b.block_id for b in pool.retained} == {1, 2}  # past the share the lowest (30) lost its hint
    assert blocks[0].retain_priority == 0
    pool.touch([blocks[2]])  # a hit revives it; freed again by a holder without hints, it keeps its own
    pool.free([blocks[2]])
    assert pool.retained.holds(blocks[2]) and blocks[2].retain_priority == 90
    pool.check_integrity()
    assert pool.forget_all() == 3 and len(pool.retained) == 0  # new weights: every hash and hint forgotten
    pool.check_integrity()


def test_block_ranges_and_checks() -> None:
    ranges = [Retention(0, 20, 50, 60.0), Retention(24, 40, 90, 5.0)]  # a range keeps the blocks before it too
    assert [block_retention(ranges, i, 16) for i in range(4)] == [(90, 60.0), (90, 60.0), (90, 5.0), (0, 0.0)]
    limits = RetentionLimits(max_duration_s=60.0)
    check_retention(ranges, 40, limits)
    for bad, why in (([Retention(0, 41, 50, 1.0)], "not within the prompt's 40"),
                     ([Retention(0, 8, 101, 1.0)], "priority must be within 1..100"),
                     ([Retention(0, 8, 50, 61.0)], "within \\(0, 60\\] seconds")):
        with pytest.raises(ValueError, match=why):
            check_retention(bad, 40, limits)
    with pytest.raises(ValueError, match="off on this server"):
        check_retention(ranges, 40, RetentionLimits(max_fraction=0.0))


def test_the_tiers_pass_over_hinted_entries() -> None:
    clock = FakeClock()
    tiers = OffloadConnector(OffloadConfig(ram_blocks=4), 4, lambda p, t, e: hash((p, tuple(t), e)),
                             RetentionLimits(max_fraction=0.5), clock)  # fmt: skip
    tiers.retain(1, 70, 50.0)
    tiers.build_connector_meta([(i, i) for i in range(1, 5)])  # 4 entries: the tier is full, 1 is the oldest
    tiers.build_connector_meta([(5, 5)])
    assert list(tiers.ram) == [3, 4, 1, 5]  # the unhinted oldest went instead; the hinted one, passed over, moved on
    clock.advance(51.0)
    tiers.build_connector_meta([(6, 6), (7, 7)])
    assert list(tiers.ram) == [1, 5, 6, 7]
    tiers.build_connector_meta([(8, 8)])
    assert 1 not in tiers.ram  # its time passed: it goes in its turn


def _engine(num_blocks: int, clock: FakeClock | None = None, **limits: float) -> EngineCore:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, retention=RetentionLimits(**limits)),
    )
    return EngineCore(config, FakeExecutor(4, num_blocks), clock=clock or FakeClock())


def _run(engine: EngineCore, req_id: str, prompt: list[int], keep: tuple[Retention, ...] = ()) -> int:
    """The request's cached prompt tokens, run to its end."""
    engine.add_request(EngineRequest(req_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True), retention=keep))
    cached = 0
    while engine.has_work():
        for out in engine.step_with_batch_queue().outputs:
            cached = max(cached, out.num_cached_tokens)
    engine.scheduler.kv.check_integrity()
    return cached


@pytest.mark.parametrize("hinted", [True, False])
def test_a_flood_of_unhinted_conversations_does_not_evict_a_hinted_prefix(hinted: bool) -> None:
    engine = _engine(num_blocks=24)
    system = list(range(1, 33))  # 8 blocks: a long system prompt
    keep = (Retention(0, 32, 80, 600.0),) if hinted else ()
    _run(engine, "vip-1", [*system, 500, 501], keep)
    for i in range(12):  # each takes 9 blocks of its own; together many times the pool
        _run(engine, f"flood-{i}", [1000 + 40 * i + j for j in range(34)])
    cached = _run(engine, "vip-2", [*system, 600, 601], keep)
    assert cached == (32 if hinted else 0)


def test_the_engine_refuses_hints_past_its_limits() -> None:
    engine = _engine(num_blocks=24, max_duration_s=60.0)
    with pytest.raises(RequestRejectedError, match="within \\(0, 60\\] seconds"):
        _run(engine, "a", list(range(1, 10)), (Retention(0, 8, 50, 3600.0),))
    with pytest.raises(RequestRejectedError, match="not within the prompt"):
        _run(engine, "b", list(range(1, 10)), (Retention(0, 30, 50, 6.0),))
    manager = KVCacheManager(CacheConfig(block_size=4, num_blocks=4, enable_prefix_caching=False))
    assert len(manager.pool.retained) == 0 and manager.pool.retained.capacity == 0


def test_the_hint_reaches_the_block_the_cache_keeps_and_each_use_renews_it() -> None:
    clock = FakeClock()
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8), clock)
    prompt = list(range(1, 10))  # 2 full blocks computed
    for seq in ("a", "b"):  # both computed the same prefix at once: b's copies are not registered
        assert kv.allocate_slots(seq, 0, len(prompt)) is not None
        kv.cache_full_blocks(seq, prompt, len(prompt), ())
    kept = kv.tables["a"][:2]
    kv.free("b", (Retention(0, 8, 70, 10.0),))  # the hint goes to a's blocks, which the cache keeps
    kv.free("a")
    assert all(kv.pool.retained.holds(b) and b.retain_priority == 70 for b in kept)
    clock.advance(8.0)
    hits = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots("c", 8, 1, hits) is not None  # a hit: in use again
    clock.advance(5.0)
    kv.free("c")  # released at 113: the hint holds until 123, not 110
    clock.advance(5.0)
    assert kv.allocate_slots("d", 0, 24) is not None  # 6 blocks: every free one but the 2 hinted
    assert all(kv.pool.retained.holds(b) for b in kept)
    kv.check_integrity()
