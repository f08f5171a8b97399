"""Router: least outstanding tokens, prefix affinity (rendezvous hashing), health, cache-aware routing on the
replicas' block events, round robin (pure Python)."""

from __future__ import annotations

import pytest

from cbserve.cluster.ingress.router import NoHealthyReplicaError, Route, Router, RoutingStats
from cbserve.scheduler import CacheConfig, KVCacheManager
from cbserve.scheduler.kv.kv_events import KVCacheEvents, prompt_block_hashes
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import cache_extra_keys


def _router(n: int = 3, imbalance: int = 100) -> Router:
    r = Router(n, block_size=4, affinity_tokens=8, max_imbalance_tokens=imbalance)
    for i in range(n):
        r.set_healthy(i, True)
    return r


def test_no_healthy_replica_raises() -> None:
    r = Router(2, block_size=4)
    with pytest.raises(NoHealthyReplicaError):
        r.choose([1, 2, 3])


def test_short_prompts_go_to_the_least_loaded() -> None:
    r = _router()
    r.add(0, 50)
    r.add(1, 10)
    r.add(2, 30)
    assert r.choose([1, 2, 3]) == 1  # shorter than a block: no affinity
    r.done(1, 10)
    r.add(1, 100)
    assert r.choose([1, 2]) == 2


def test_shared_prefix_sticks_to_one_replica_whatever_follows() -> None:
    r = _router()
    prefix = list(range(100, 108))
    targets = {r.choose(prefix + [i, i + 1, i + 2]) for i in range(20)}
    assert len(targets) == 1
    others = {r.choose(list(range(j, j + 8)) + [1]) for j in range(0, 400, 8)}
    assert len(others) == 3  # different prefixes spread over all replicas


def test_affinity_yields_to_load_past_the_imbalance() -> None:
    r = _router(imbalance=100)
    prompt = list(range(100, 112))
    pref = r.choose(prompt)
    r.add(pref, 101)
    assert r.choose(prompt) != pref  # 101 more tokens than the least loaded: go elsewhere
    r.done(pref, 101)
    assert r.choose(prompt) == pref


def test_unhealthy_replica_is_skipped_and_affinity_is_stable_for_the_rest() -> None:
    r = _router()
    prompts = [list(range(j, j + 8)) + [0] for j in range(0, 800, 8)]
    before = [r.choose(p) for p in prompts]
    r.set_healthy(1, False)
    after = [r.choose(p) for p in prompts]
    assert 1 not in after
    # rendezvous hashing: prompts that were not on the lost replica keep their replica
    assert all(a == b for a, b in zip(after, before, strict=True) if b != 1)


def test_bad_construction_is_rejected() -> None:
    with pytest.raises(ValueError):
        Router(0, block_size=16)
    with pytest.raises(ValueError):
        Router(2, block_size=16, adapter_memory=0)


def test_an_adapter_goes_where_it_was_served_within_the_imbalance_bound() -> None:
    r = Router(3, block_size=4, affinity_tokens=8, max_imbalance_tokens=100, adapter_memory=2)
    for i in range(3):
        r.set_healthy(i, True)
    prompts = [list(range(j, j + 12)) for j in range(0, 400, 12)]
    first = {r.choose(p, lora_id=7) for p in prompts}
    assert len(first) == 1  # unseen: its requests gather on one replica whatever their prefixes
    home = first.pop()
    r.add(home, 50, lora_id=7)
    assert {r.choose(p, lora_id=7) for p in prompts} == {home}  # now it holds the adapter
    r.add(home, 51)
    assert all(r.choose(p, lora_id=7) != home for p in prompts)  # 101 more tokens than the least loaded
    r.done(home, 51)
    other = (home + 1) % 3
    r.add(other, 0, lora_id=7)  # two replicas hold it: the less loaded one
    assert r.choose(prompts[0], lora_id=7) == other
    for lora in (8, 9):  # the replica forgets all but its last adapter_memory adapters
        r.add(other, 0, lora_id=lora)
    assert list(r.replicas[other].adapters) == [8, 9]
    assert r.choose(prompts[0], lora_id=7) == home
    base = [r.choose(p) for p in prompts]  # requests without an adapter: prefix affinity as before
    assert base == [r.preferred(r.prefix_key(p), [0, 1, 2]) for p in prompts]  # type: ignore[arg-type]


# ---- cache-aware routing: the replicas' prefix caches as their block events describe them ------------------
BS = 4


def _cached(r: Router, idx: int, prompt: list[int], num_blocks: int, extra: tuple = ()) -> list[int]:
    """Tell the router replica ``idx`` cached the first ``num_blocks`` blocks of ``prompt``; their hashes."""
    hashes = list(prompt_block_hashes(prompt + [0], BS, extra))[:num_blocks]
    r.apply_cache_events(idx, KVCacheEvents(stored=hashes))
    return hashes


def _prompt_where_affinity_prefers(r: Router, idx: int) -> list[int]:
    """A prompt whose first block-aligned chunk rendezvous hashing sends to replica ``idx``."""
    for j in range(1000):
        prompt = list(range(1000 + 40 * j, 1040 + 40 * j))
        if r.preferred(r.prefix_key(prompt), r.healthy_replicas()) == idx:  # type: ignore[arg-type]
            return prompt
    raise AssertionError("no such prompt")


def test_the_longest_cached_prefix_wins_over_affinity() -> None:
    r = _router()
    prompt = _prompt_where_affinity_prefers(r, 0)
    _cached(r, 1, prompt, 2)
    _cached(r, 2, prompt, 5)
    _cached(r, 0, list(range(40)), 9)  # something else
    assert r.choose(prompt) == 2
    assert r.take_stats() == RoutingStats({"cache_hit": 1}, {5 * BS: 1})
    r.add(2, 50)
    assert r.choose(prompt[:9]) == 1  # 2 cacheable blocks (the last token never is), both hold them: less loaded
    assert r.choose(prompt) == 2  # still within the bound
    assert r.take_stats() == RoutingStats({"cache_hit": 2}, {2 * BS: 1, 5 * BS: 1})
    assert [x.cache_hits for x in r.replicas] == [0, 1, 2]


def test_without_a_hit_the_affinity_rule_decides() -> None:
    r = _router()
    prompt = _prompt_where_affinity_prefers(r, 1)
    _cached(r, 0, prompt, 2, extra=("salt",))  # another salt's blocks never match
    assert r.choose(prompt) == 1
    assert r.take_stats() == RoutingStats({"affinity": 1}, {0: 1})
    assert r.choose([1, 2]) in (0, 1, 2) and r.take_stats().decisions == {"least_loaded": 1}
    assert r.choose(prompt, extra_keys=("salt",)) == 0  # with that salt, its blocks are a hit


def test_a_hit_shorter_than_the_affinity_chunk_does_not_count() -> None:
    r = _router()  # affinity chunk: 8 tokens, 2 blocks
    template = [5, 5, 5, 5]  # one block every prompt shares, as a chat template's start
    _cached(r, 2, template + [6, 6, 6, 6], 1)
    prompts = [template + list(range(j, j + 8)) for j in range(0, 400, 8)]
    assert len({r.choose(p) for p in prompts}) == 3  # spread by the affinity rule, not all on replica 2
    assert r.take_stats().decisions == {"affinity": len(prompts)}
    assert r.choose(template + [7]) == 2  # a prompt with one cacheable block: its whole cacheable prefix is a hit


def test_the_load_bound_overrides_the_longest_prefix() -> None:
    r = _router(imbalance=100)
    prompt = _prompt_where_affinity_prefers(r, 0)
    _cached(r, 1, prompt, 6)
    _cached(r, 2, prompt, 3)
    r.add(1, 101)  # 101 more outstanding tokens than the least loaded: out of bounds
    assert r.choose(prompt) == 2  # the longest prefix among those within the bound
    r.add(2, 101)
    assert r.choose(prompt) == 0  # no holder within the bound: the affinity rule (replica 0 is the least loaded)
    assert r.take_stats().decisions == {"cache_hit": 1, "affinity": 1}
    r.done(1, 101)
    assert r.choose(prompt) == 1


def test_a_queue_of_prefills_outweighs_a_cached_prefix_until_it_drains() -> None:
    """The cache holder has 100 prompt tokens to prefill before a new request: prefilling the request's 40 tokens on
    the idle replica gives its first token sooner (its uncached tokens count twice: 100 + 2 x 4 against 2 x 40);
    once those prefills are done, the cache wins again."""
    r = _router(2, imbalance=10_000)
    prompt = _prompt_where_affinity_prefers(r, 0)  # 40 tokens
    _cached(r, 0, prompt, 9)
    assert r.route(prompt) == Route(0, 4) and r.take_stats().decisions == {"cache_hit": 1}
    r.add(0, 0, prefill_tokens=100)
    assert r.route(prompt) == Route(1, 40)  # a cost of 108 on 0, 80 on 1
    assert r.take_stats() == RoutingStats({"least_loaded": 1}, {0: 1})
    r.add(1, 0, prefill_tokens=80)
    assert r.route(prompt) == Route(0, 4)  # 108 < 160
    r.prefilled(0, 100)
    r.prefilled(0, 100)  # more than was pending: never below zero
    assert r.replicas[0].pending_prefill_tokens == 0 and r.route(prompt).replica == 0


def test_eviction_events_remove_blocks_and_a_reset_forgets_them() -> None:
    r = _router()
    prompt = _prompt_where_affinity_prefers(r, 0)
    hashes = _cached(r, 1, prompt, 6)
    r.apply_cache_events(1, KVCacheEvents(removed=hashes[2:3]))  # the third block evicted: 2 blocks still match
    assert r.choose(prompt) == 1 and r.take_stats().matched_tokens == {2 * BS: 1}
    r.apply_cache_events(1, KVCacheEvents(removed=hashes[:1]))  # the first: nothing matches any more
    assert r.choose(prompt) == 0 and r.index.num_blocks(1) == 4
    _cached(r, 2, prompt, 2)
    r.apply_cache_events(2, KVCacheEvents(reset=True))  # its channel broke: its cache is unknown
    assert r.choose(prompt) == 0 and r.index.num_blocks(2) == 0


@pytest.mark.parametrize("salt, lora", [(None, None), ("tenant-a", None), ("tenant-a", 3)])
def test_the_routers_hashes_are_the_kv_managers(salt: str | None, lora: int | None) -> None:
    """Blocks a real KV manager cached (with a salt and an adapter) are found by the router from the prompt's
    token ids and the request's extra keys: as many as the manager's own prefix hit serves."""
    adapter = None if lora is None else LoRARequest("a", lora, "/peft")
    extra = cache_extra_keys(salt, adapter)
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=32))
    kv.record_events()
    cached = list(range(300, 322))  # 5 full blocks + 2 tokens
    assert kv.allocate_slots("a", 0, len(cached)) is not None
    kv.cache_full_blocks("a", cached, len(cached), extra)
    r = _router(2)
    events = kv.take_events()
    assert events is not None
    r.apply_cache_events(1, events)
    prompt = cached[:14] + [9, 9, 9, 9, 9]  # shares 3 full blocks (and 2 tokens)
    hits = len(kv.get_computed_blocks(prompt, extra)[0])
    assert hits == 3
    assert r.index.matched_blocks(prompt, extra, [0, 1]) == {0: 0, 1: hits}
    assert r.choose(prompt, lora_id=lora, extra_keys=extra) == 1
    assert r.index.matched_blocks(prompt, cache_extra_keys("other", adapter), [0, 1]) == {0: 0, 1: 0}


def test_round_robin_takes_turns_whatever_the_prefix_or_cache() -> None:
    r = Router(3, block_size=BS, mode="round_robin")
    for i in range(3):
        r.set_healthy(i, True)
    prompt = list(range(40))
    _cached(r, 0, prompt, 9)
    r.add(1, 10_000)
    assert [r.choose(prompt) for _ in range(6)] == [1, 2, 0, 1, 2, 0]
    r.set_healthy(2, False)
    assert sorted(r.choose(prompt) for _ in range(4)) == [0, 0, 1, 1]
    assert r.take_stats().decisions == {"round_robin": 10}


def test_affinity_mode_ignores_the_caches() -> None:
    r = Router(3, block_size=BS, affinity_tokens=8, mode="affinity")
    for i in range(3):
        r.set_healthy(i, True)
    prompt = _prompt_where_affinity_prefers(r, 0)
    _cached(r, 1, prompt, 9)
    assert r.choose(prompt) == 0
    assert r.take_stats() == RoutingStats({"affinity": 1}, {})  # no prefix matched: none looked up
    with pytest.raises(ValueError, match="routing mode"):
        Router(2, block_size=BS, mode="random")


def test_a_tiered_hit_scores_below_a_pool_hit_and_above_a_miss() -> None:
    """The replicas' KV tiers (their events' tier fields): blocks a replica's pool holds, then blocks after them
    its tiers hold, count as cached; at the same length a pool hit wins, and a tiered hit beats a miss."""
    r = _router()
    prompt = _prompt_where_affinity_prefers(r, 0)  # 9 full blocks; no hit anywhere: affinity says 0
    hashes = list(prompt_block_hashes(prompt + [0], BS))[:8]
    r.apply_cache_events(1, KVCacheEvents(tier_stored=hashes[:6]))  # replica 1: 6 blocks in its tiers only
    assert r.index.matched(prompt, (), [0, 1, 2]) == {0: (0, 0), 1: (0, 6), 2: (0, 0)}
    assert r.choose(prompt) == 1 and r.take_stats().decisions == {"cache_hit": 1}
    r.apply_cache_events(2, KVCacheEvents(stored=hashes[:6]))  # replica 2: the same 6 blocks in its pool
    assert r.choose(prompt) == 2
    r.apply_cache_events(1, KVCacheEvents(stored=hashes[:2], tier_stored=hashes[6:8]))  # 2 pool + 6 tiered
    assert r.index.matched(prompt, (), [1]) == {1: (2, 6)}
    assert r.choose(prompt) == 1  # 8 cached blocks (2 to load) beat 6 in the pool
    r.apply_cache_events(1, KVCacheEvents(tier_removed=hashes[:8]))  # its tiers dropped them: pool blocks stay
    assert r.index.matched(prompt, (), [1]) == {1: (2, 0)} and r.choose(prompt) == 2
    r.apply_cache_events(2, KVCacheEvents(reset=True, tier_stored=hashes[:1]))  # a snapshot: tiers only
    assert r.index.matched(prompt, (), [2]) == {2: (0, 1)}
