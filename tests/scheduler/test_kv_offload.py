"""The KV tiers' index on the scheduler side (scheduler/kv/offload.py), alone: what it offers an admission, what each
step asks of the worker, and how it keeps each tier within its size."""

from __future__ import annotations

from cbserve.scheduler.config import CacheConfig, OffloadConfig
from cbserve.scheduler.kv.connector import KVTransferResult
from cbserve.scheduler.kv.kv_cache_manager import KVCacheManager
from cbserve.scheduler.kv.kv_events import KVCacheEvents, stable_key_hasher
from cbserve.scheduler.kv.offload import OffloadConnector, scan_disk

BS = 4
HASH = stable_key_hasher(BS)
PROMPT = list(range(1, 22))  # 5 full blocks the tiers may serve (the last token is always computed)


def _hashes(tokens: list[int], extra: tuple = ()) -> list[int]:
    out, parent = [], None
    for i in range((len(tokens) - 1) // BS):
        parent = HASH((parent, tuple(tokens[i * BS : (i + 1) * BS]), extra if parent is None else ()))
        out.append(parent)
    return out


def _connector(ram: int = 8, disk_dir: str | None = None, disk: int = 0) -> OffloadConnector:
    """The tiers' index as the KV manager builds it (its stable block hash)."""
    tiers = KVCacheManager(CacheConfig(block_size=BS, num_blocks=16, offload=OffloadConfig(ram, disk_dir, disk))).tiers
    assert tiers is not None
    return tiers


def test_completed_blocks_are_stored_once_and_offered_after_the_pools_hits() -> None:
    c = _connector()
    hashes = _hashes(PROMPT)
    t = c.build_connector_meta([(10 + i, h) for i, h in enumerate(hashes[:3])])
    assert t is not None and t.stores == [(10, hashes[0]), (11, hashes[1]), (12, hashes[2])] and not t.loads
    assert c.build_connector_meta([(20, hashes[0])]) is None  # held already: only touched
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == (hashes[:3], False)
    assert c.get_num_new_matched_tokens(PROMPT, (), hashes[0], 1) == (hashes[1:3], False)  # after 1 pool hit
    c.update_state_after_alloc([(30, hashes[1]), (31, hashes[2])])
    t = c.build_connector_meta([])
    assert t is not None and t.loads == [(30, hashes[1]), (31, hashes[2])]
    assert c.stats.hit_tokens_ram == 2 * BS and c.stats.blocks_loaded == 2


def test_the_ram_tier_evicts_least_recently_used_and_says_so() -> None:
    c = _connector(ram=2)
    h = _hashes(PROMPT)
    c.build_connector_meta([(1, h[0]), (2, h[1])])
    c.get_num_new_matched_tokens(PROMPT, (), None, 0)
    c.update_state_after_alloc([(5, h[0])])  # h[0] used: h[1] is now the oldest
    t = c.build_connector_meta([(3, h[2])])
    assert t is not None and t.evict == [h[1]] and t.stores == [(3, h[2])]
    assert list(c.ram) == [h[0], h[2]] and c.stats.evictions_ram == 1


def test_disk_blocks_are_prefetched_while_the_request_waits(tmp_path) -> None:
    c = _connector(ram=8, disk_dir=str(tmp_path), disk=16)
    h = _hashes(PROMPT)
    c.update_connector_output(KVTransferResult(on_disk=h[:4]))
    c.ram.clear()  # as after the RAM tier evicted them
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == ([], True)
    t = c.build_connector_meta([])
    assert t is not None and t.prefetch == h[:4] and t.poll  # one request for each, then polls until they land
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == ([], True)
    assert c.build_connector_meta([]).prefetch == []  # type: ignore[union-attr]
    c.update_connector_output(KVTransferResult(prefetched=h[:2], failed=[h[2]]))  # h[3] still on its way
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == (h[:2], False)  # stops at the failed one
    assert h[2] not in c.disk and h[2] not in c.ram
    c.update_state_after_alloc([(7, h[0]), (8, h[1])])
    assert c.stats.hit_tokens_disk == 2 * BS and c.stats.prefetch_failures == 1


def test_the_disk_tier_keeps_to_its_size_and_a_new_index_finds_the_files(tmp_path) -> None:
    c = _connector(ram=8, disk_dir=str(tmp_path), disk=2)
    h = _hashes(PROMPT)
    c.update_connector_output(KVTransferResult(on_disk=h[:3]))
    assert list(c.disk) == h[1:3] and c.build_connector_meta([]).disk_evict == [h[0]]  # type: ignore[union-attr]
    for x in h[:3]:
        (tmp_path / f"{x:016x}.kv").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not a block")
    assert sorted(scan_disk(str(tmp_path))) == sorted(h[:3])
    assert len(_connector(ram=8, disk_dir=str(tmp_path), disk=2).disk) == 2  # trimmed at start too


def test_a_dropped_steps_stores_are_forgotten_and_its_evictions_asked_again() -> None:
    c = _connector(ram=2)
    h = _hashes(PROMPT)
    t1 = c.build_connector_meta([(1, h[0]), (2, h[1])])
    t2 = c.build_connector_meta([(3, h[2])])  # evicts h[0]
    assert t2 is not None and t2.evict == [h[0]]
    c.steps_dropped([t1, t2])  # type: ignore[list-item]
    t = c.build_connector_meta([])
    assert t is not None and set(t.evict) == {h[0], h[1], h[2]} and not c.ram


def test_lora_blocks_stay_out_of_the_tiers() -> None:
    kv = KVCacheManager(CacheConfig(block_size=BS, num_blocks=16, offload=OffloadConfig(8)))
    c = _connector()
    lora = (("lora", 3),)
    assert c.get_num_new_matched_tokens(PROMPT, lora, None, 0) == ([], False)
    for seq, extra in (("base", ()), ("adapter", lora)):
        kv.allocate_slots(seq, 0, len(PROMPT))
        kv.hashes[seq] = []
        kv.cache_full_blocks(seq, PROMPT, len(PROMPT), extra)
    assert [h for _, h in kv.take_completed()] == _hashes(PROMPT + [0, 0, 0])[:5]  # the base model's only
    assert kv.take_completed() == []


def test_the_tiers_tell_a_router_which_blocks_they_hold(tmp_path) -> None:
    """Tier events (kv_events.py's tier fields): a block is in while the RAM or the disk tier holds it."""
    c = _connector(ram=2, disk_dir=str(tmp_path), disk=1)
    c.record_events()
    h = _hashes(PROMPT)
    c.build_connector_meta([(1, h[0]), (2, h[1])])
    assert c.take_events() == KVCacheEvents(stored=[h[0], h[1]])
    c.update_connector_output(KVTransferResult(on_disk=[h[0]]))
    c.build_connector_meta([(3, h[2])])  # h[0] leaves RAM but stays on disk: still held
    assert c.take_events() == KVCacheEvents(stored=[h[2]])
    c.update_connector_output(KVTransferResult(on_disk=[h[1]]))  # held in RAM already; the disk holds 1: h[0] goes
    assert c.take_events() == KVCacheEvents(removed=[h[0]])
    assert sorted(c.tiered_hashes()) == sorted(h[1:3])
    assert c.take_events() is None


def test_a_dropped_steps_prefetches_are_asked_again_and_a_stray_report_is_ignored(tmp_path) -> None:
    c = _connector(ram=8, disk_dir=str(tmp_path), disk=16)
    h = _hashes(PROMPT)
    c.update_connector_output(KVTransferResult(on_disk=h[:2]))
    c.ram.clear()
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == ([], True)
    t = c.build_connector_meta([])
    assert t is not None and t.prefetch == h[:2]
    c.steps_dropped([t])  # the step never ran at the worker: without asking again, the request would wait for good
    assert c.build_connector_meta([]).prefetch == h[:2]  # type: ignore[union-attr]
    c.update_connector_output(KVTransferResult(prefetched=h[:2] + h[:1]))  # the first one twice: both reads ran
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == (h[:2], False)


def test_prefetches_stay_within_half_the_ram_tier_and_a_waiting_prompts_blocks_are_kept(tmp_path) -> None:
    c = _connector(ram=6, disk_dir=str(tmp_path), disk=16)
    h = _hashes(PROMPT)
    c.update_connector_output(KVTransferResult(on_disk=h))
    c.ram.clear()
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == ([], True)
    assert c.build_connector_meta([]).prefetch == h[:3]  # type: ignore[union-attr]  # 3 of 6 slots, once
    c.update_connector_output(KVTransferResult(prefetched=h[:2]))  # h[2] still on its way
    other = _hashes(list(range(500, 541)))
    c.build_connector_meta([(9, other[0]), (10, other[1])])
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == (h[:2], True)  # ready ones kept: it waits for h[2]
    c.build_connector_meta([(11, other[2]), (12, other[3])])  # full: the oldest entry it does not want goes
    assert h[0] in c.ram and h[1] in c.ram and other[0] not in c.ram and c.ram[h[2]] is False


def test_a_router_learns_what_the_disk_tier_held_at_start(tmp_path) -> None:
    h = _hashes(PROMPT)
    for x in h[:3]:
        (tmp_path / f"{x:016x}.kv").write_bytes(b"x")
    c = _connector(ram=8, disk_dir=str(tmp_path), disk=16)
    c.record_events()
    events = c.take_events()
    assert events is not None and sorted(events.stored) == sorted(h[:3])


def test_a_remote_prompt_is_pulled_while_it_waits_and_a_failed_pull_is_computed() -> None:
    from cbserve.scheduler.requests.kv_transfer import KVTransferParams

    c = _connector(ram=8)
    h = _hashes(PROMPT)
    remote = KVTransferParams(remote_engine="model-1-abc", remote_blocks=3)  # the producer published 3 blocks
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0, remote) == ([], True)
    t = c.build_connector_meta([])
    assert t is not None and t.pulls == [(x, "model-1-abc") for x in h[:3]] and t.poll and not t.prefetch
    c.update_connector_output(KVTransferResult(prefetched=h[:2], pulled=h[:2], failed=[h[2]], bytes_pulled=99))
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0, remote) == (h[:2], False)  # h[2] is not asked again
    assert ("model-1-abc", h[2]) in c.unpullable and c.build_connector_meta([]).evict == [h[2]]  # type: ignore[union-attr]
    c.update_state_after_alloc([(7, h[0]), (8, h[1])])
    s = c.stats
    assert (s.blocks_pulled, s.pull_failures, s.prefetch_failures, s.hit_tokens_remote, s.bytes_pulled) == \
        (2, 1, 0, 2 * BS, 99)  # fmt: skip
    assert c.get_num_new_matched_tokens(PROMPT, (), None, 0) == (h[:2], False)  # now RAM-tier hits for anyone
