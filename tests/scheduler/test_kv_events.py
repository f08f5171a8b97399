"""Prefix-cache events (scheduler/kv/kv_events.py): the engine reports every block registered in and evicted from its
prefix cache by a stable hash, and a mirror fed only by those events always equals what the cache holds; the hash
a router computes from a prompt's token ids is the one the engine reports for the same tokens and extra keys."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_fakes import Overlapped, make_engine, req, run

from cbserve.scheduler import CacheConfig, KVCacheManager, QueueFullError, RequestRejectedError, SpeculativeConfig
from cbserve.scheduler.engine_core import EngineCore
from cbserve.scheduler.kv.kv_events import (
    KVCacheEvents,
    KVEventRecorder,
    block_event_hash,
    prompt_block_hashes,
)
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import cache_extra_keys


def _manager(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    kv = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks))
    kv.record_events()
    return kv


def _compute(kv: KVCacheManager, seq_id: str, tokens: list[int], extra: tuple = ()) -> None:
    hits = kv.get_computed_blocks(tokens, extra)
    num_cached = len(hits[0]) * kv.block_size
    assert kv.allocate_slots(seq_id, num_cached, len(tokens) - num_cached, hits) is not None
    kv.cache_full_blocks(seq_id, tokens, len(tokens) - 1, extra)
    kv.check_integrity()


@pytest.mark.parametrize("extra", [(), cache_extra_keys("salt", None),
                                   cache_extra_keys("s", LoRARequest("a", 3, "/p"))])  # fmt: skip
def test_the_router_side_hashes_equal_what_the_engine_reports(extra: tuple) -> None:
    kv = _manager()
    prompt = list(range(100, 114))  # 3 full blocks (+ 2 tokens)
    _compute(kv, "a", prompt, extra)
    events = kv.take_events()
    assert events is not None and events.reset and not events.removed  # a fresh recorder starts with a snapshot
    assert events.stored == list(prompt_block_hashes(prompt, 4, extra))
    assert len(events.stored) == 3 and kv.take_events() is None  # drained
    assert set(prompt_block_hashes(prompt, 4, ())) & set(events.stored) == (set(events.stored) if not extra else set())


def test_a_duplicate_sequence_chains_from_the_cached_content_even_once_evicted() -> None:
    kv = _manager(num_blocks=16)
    prompt = list(range(20))  # 5 full blocks
    _compute(kv, "a", prompt)  # registers 4 (the last token is not computed yet)
    # "b" computes the same prompt without hits (as when both are admitted in one step): its blocks are duplicates
    # and stay unregistered
    assert kv.allocate_slots("b", 0, len(prompt)) is not None
    kv.cache_full_blocks("b", prompt, 16, ())
    first = kv.take_events()
    assert first is not None and len(first.stored) == 4
    kv.free("a")  # its blocks go to the free queue's tail, last block first
    kv.allocate_slots("c", 0, 40)  # 10 blocks: the 6 never used, then "a"'s last 4: 3 cached ones are evicted
    evicted = kv.take_events()
    assert evicted is not None and sorted(evicted.removed) == sorted(first.stored[1:]) and not evicted.stored
    longer = prompt + [1]
    kv.allocate_slots("b", len(prompt), 1)  # takes the last free block: "a"'s first, evicted too
    kv.cache_full_blocks("b", longer, len(prompt), ())  # block 4 chains from "b"'s own hash of block 3: no rehash
    stored = kv.take_events()
    assert stored is not None and stored.stored == list(prompt_block_hashes(longer, 4))[-1:]
    assert stored.removed == first.stored[:1]
    kv.check_integrity()


def test_eviction_and_reset_report_removals() -> None:
    kv = _manager(num_blocks=4)
    _compute(kv, "a", list(range(9)))  # 2 cached blocks + 1 partial
    stored = kv.take_events()
    assert stored is not None and len(stored.stored) == 2
    kv.free("a")
    kv.allocate_slots("b", 0, 4)  # the block never used
    assert kv.take_events() is None
    kv.allocate_slots("b", 4, 12)  # "a"'s three, last first: both cached blocks are evicted
    removed = kv.take_events()
    assert removed is not None and sorted(removed.removed) == sorted(stored.stored)
    kv.free("b")
    _compute(kv, "c", list(range(50, 59)))
    kv.free("c")
    kv.take_events()
    assert kv.pool.reset_prefix_cache()
    reset = kv.take_events()
    assert reset is not None and len(reset.removed) == 2 and kv.cached_event_hashes() == []


def test_recorder_nets_events_and_apply_mirrors_them() -> None:
    rec = KVEventRecorder()
    held = {1, 2}
    rec.store(3)
    rec.remove(3)  # stored then evicted in one window: removed
    rec.remove(1)
    rec.store(1)  # evicted then stored again: stored
    rec.remove(2)
    events = rec.take()
    assert events is not None and sorted(events.stored) == [1] and sorted(events.removed) == [2, 3]
    events.apply_to(held)
    assert held == {1} and rec.take() is None
    rec.add(KVCacheEvents(stored=[5]))
    rec.add(KVCacheEvents(stored=[7, 8], reset=True))  # a snapshot replaces what came before
    rec.add(KVCacheEvents(removed=[8]))
    snap = rec.take()
    assert snap is not None and snap.reset and snap.stored == [7] and snap.removed == [8]
    snap.apply_to(held)
    assert held == {7}


def test_the_hash_is_the_same_in_another_process() -> None:
    code = ("from cbserve.scheduler.kv.kv_events import block_event_hash as h; "
            "print(h(h(None, [1, 2, 3], ('s', ('lora', 2))), [4, 5, 6]))")  # fmt: skip
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}  # fmt: skip
    assert outs == {str(block_event_hash(block_event_hash(None, [1, 2, 3], ("s", ("lora", 2))), [4, 5, 6]))}


def test_events_are_off_by_default() -> None:
    engine, _ = make_engine(block_size=2)
    engine.add_request(req("a", 9, max_tokens=3))
    results = run(engine).results
    assert all(r.kv_events is None for r in results)
    kv = engine.scheduler.kv
    assert kv.pool.events is None and kv.pool.key_hash is hash and kv.cached_event_hashes() == []
    assert kv.pool.cached  # the cache works, keyed by the cheap per-process hash


def test_with_events_the_pool_key_is_the_event_hash() -> None:
    kv = _manager()
    prompt = list(range(30, 43))  # 3 full blocks (+ 1 token)
    extra = cache_extra_keys("salt", LoRARequest("a", 2, "/p"))
    _compute(kv, "a", prompt, extra)
    expected = list(prompt_block_hashes(prompt, 4, extra))
    assert kv.hashes["a"] == expected and list(kv.pool.cached) == expected  # one hash per block, for both
    assert [b.block_hash for b in kv.pool.cached.values()] == expected
    events = kv.take_events()
    assert events is not None and events.stored == expected
    assert kv.get_computed_blocks(prompt, extra)[1] == expected


def test_with_events_salts_and_adapters_still_never_share_blocks() -> None:
    kv = _manager(num_blocks=32)
    prompt = list(range(9))  # 2 full blocks (+ 1 token)
    variants = [(), cache_extra_keys("s1", None), cache_extra_keys("s2", None),
                cache_extra_keys(None, LoRARequest("a", 1, "/a")), cache_extra_keys(None, LoRARequest("b", 2, "/b")),
                cache_extra_keys("s1", LoRARequest("a", 1, "/a"))]  # fmt: skip
    for i, extra in enumerate(variants):
        assert kv.get_computed_blocks(prompt, extra)[0] == []  # nobody else's blocks
        _compute(kv, f"r{i}", prompt, extra)
        assert len(kv.get_computed_blocks(prompt, extra)[0]) == 2  # its own
    assert len(kv.pool.cached) == 2 * len(variants)


def test_events_are_turned_on_before_blocks_are_used() -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=8))
    _compute(kv, "a", list(range(9)))
    with pytest.raises(RuntimeError):
        kv.record_events()  # "a"'s hash chain is the per-process one
    assert kv.pool.events is None and len(kv.pool.cached) == 2
    kv.free("a")
    kv.record_events()  # the blocks cached under the per-process hash are forgotten
    events = kv.take_events()
    assert events is not None and events.reset and events.stored == [] and not kv.pool.cached
    kv.record_events()  # idempotent
    _compute(kv, "b", list(range(9)))
    assert kv.cached_event_hashes() == list(prompt_block_hashes(list(range(9)), 4))


# ---- property: a mirror fed by the events equals the cache after any workload -------------------------------
PREFIXES = [[7] * 9, [1, 2, 3, 4, 5, 6], []]
request_specs = st.fixed_dictionaries({
    "prefix": st.integers(0, len(PREFIXES) - 1), "tail": st.lists(st.integers(0, 60), max_size=8),
    "max_tokens": st.integers(1, 10), "n": st.integers(1, 2), "salt": st.sampled_from([None, "s"]),
})  # fmt: skip
operations = st.lists(st.one_of(st.tuples(st.just("add"), request_specs), st.tuples(st.just("step"), st.integers(1, 4)),
                                st.tuples(st.just("abort"), st.integers(0, 40))), max_size=50)  # fmt: skip
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)


def _check_mirror(engine: EngineCore, held: set[int], prompts: list[tuple[list[int], tuple]]) -> None:
    kv = engine.scheduler.kv
    assert held == set(kv.cached_event_hashes())
    assert len(kv.cached_event_hashes()) == len(kv.pool.cached)  # every cached block has its event hash
    for prompt, extra in prompts:  # the router's longest match is the engine's prefix hit
        hits = 0
        for h in prompt_block_hashes(prompt, kv.block_size, extra):
            if h not in held:
                break
            hits += 1
        assert hits == len(kv.get_computed_blocks(prompt, extra)[0])


@pytest.mark.parametrize("mode", ["sync", "async-scheduling", "speculative"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]), kv_tokens=st.integers(12, 40), ops=operations)
def test_a_mirror_of_the_events_equals_the_cache(mode: str, block_size: int, kv_tokens: int, ops: list) -> None:
    engine, ex = make_engine(block_size=block_size, num_blocks=kv_tokens // block_size, max_seqs=4, max_batched=24,
                             max_model_len=32, async_scheduling=mode == "async-scheduling", max_waiting=30,
                             speculative=SPEC if mode == "speculative" else None, copying=mode == "speculative")
    engine = EngineCore(engine.config, ex, clock=engine.clock, kv_events=True)
    driver = Overlapped(engine) if mode == "async-scheduling" else None
    held: set[int] = set()
    prompts: list[tuple[list[int], tuple]] = []
    ids: list[str] = []
    for i, op in enumerate(ops):
        if op[0] == "add":
            spec = op[1]
            r = req(f"r{i}", PREFIXES[spec["prefix"]] + spec["tail"], max_tokens=spec["max_tokens"], n=spec["n"],
                    salt=spec["salt"])  # fmt: skip
            try:
                engine.add_request(r)
                ids.append(r.req_id)
            except (RequestRejectedError, QueueFullError):
                continue
            prompts.append((list(r.prompt_token_ids), cache_extra_keys(r.cache_salt, None)))
        elif op[0] == "abort" and ids:
            engine.abort_request(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1] if op[0] == "step" else 0):
                for res in [engine.step()] if driver is None else driver.step():
                    if res.kv_events is not None:
                        res.kv_events.apply_to(held)
                _check_mirror(engine, held, prompts)
    for res in run(engine, max_steps=3000, driver=driver).results:
        if res.kv_events is not None:
            res.kv_events.apply_to(held)
    _check_mirror(engine, held, prompts)
    event(f"evictions: {engine.scheduler.kv.pool.num_evictions > 0}")
    engine.check_integrity()
