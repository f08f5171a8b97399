"""Per-sequence block tables on top of the block pool: paged allocation, prefix caching by chained block
hashes, fork by reference counting and copy-on-write of a shared, partly filled block.

The manager knows sequences only by id; callers pass the token ids and counts it needs.

Sliding-window models (Mistral, Gemma 2/3, Qwen with ``use_sliding_window``, Phi-3): a sequence keeps every
block of its context, including those that fell out of every layer's window. They are not freed, because:
one block table serves all layers, and the families that interleave global layers with windowed ones (Gemma
2/3, Qwen) read every block again in the global layers, so only an all-windowed model (Mistral, Phi-3) could
drop any; a freed block in the middle of a table would break the prefix cache, whose chained hashes make a
block reusable only together with all blocks before it; and a preempted sequence is recomputed from its whole
prompt anyway. The scheduler, which sees no model, would also need each layer's window. The cost is memory:
such a sequence holds its whole context's blocks, as a global-attention model's does. The C and Triton attention
kernels read only the blocks inside each layer's window (see ``cbserve.worker.attention``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from cbserve.scheduler.config import CacheConfig
from cbserve.scheduler.kv.block_pool import BlockPool, KVBlock
from cbserve.scheduler.kv.kv_events import KVCacheEvents, stable_key_hasher
from cbserve.scheduler.kv.offload import OffloadConnector, tier_ok
from cbserve.scheduler.requests.request import RequestStatus
from cbserve.scheduler.requests.retention import Retention, block_retention

ComputedBlocks = tuple[list[KVBlock], list[int]]  # prefix-cache hit blocks and their hashes
NO_HITS: ComputedBlocks = ([], [])


class KVCacheManager:
    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching, config.retention, clock)
        self.tables: dict[str, list[KVBlock]] = {}
        self.hashes: dict[str, list[int]] = {}  # chain hashes (pool keys) of each sequence's full computed blocks
        self.block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write copies, drained per step
        # the KV tiers below the pool (offload.py), keyed by stable hashes; the blocks registered since the last step,
        # (id, hash), which they may store; their events come with the pool's
        self.tiers: OffloadConnector | None = None
        self.completed: list[tuple[int, int]] = []
        # sequences whose KV predates the last ``reset_prefix_cache``: their blocks are never registered
        self.stale: set[str] = set()
        if config.offload is not None:
            self.pool.key_hash = stable_key_hasher(self.block_size)
            self.tiers = OffloadConnector(config.offload, self.block_size, self.block_hash, config.retention, clock)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------------
    def block_key(self, parent_hash: int | None, tokens: Seq[int], extra_keys: tuple) -> tuple:
        return (parent_hash, tuple(tokens), extra_keys if parent_hash is None else ())

    def block_hash(self, parent_hash: int | None, tokens: Seq[int], extra_keys: tuple) -> int:
        """The pool's key hash of a full block (chained from its parent's)."""
        return self.pool.key_hash(self.block_key(parent_hash, tokens, extra_keys))

    def get_computed_blocks(self, token_ids: list[int], extra_keys: tuple = ()) -> ComputedBlocks:
        """Longest cached prefix of full blocks. The last token is never served from the cache, so at
        least one token is computed (and sampled). No side effects: allocate_slots takes the blocks."""
        if not self.enable_caching:
            return NO_HITS
        bs = self.block_size
        key_hash = self.pool.key_hash
        blocks: list[KVBlock] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range((len(token_ids) - 1) // bs):
            key = self.block_key(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            block_hash = key_hash(key)
            block = self.pool.get_cached_block(block_hash, key)
            if block is None:
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
        return blocks, hashes

    def cache_full_blocks(
        self, seq_id: str, token_ids: list[int], num_computed: int, extra_keys: tuple
    ) -> None:
        """Register the sequence's full blocks whose KV is computed (called after each step)."""
        if seq_id in self.stale:
            return
        hashes = self.hashes[seq_id]
        table = self.tables[seq_id]
        bs = self.block_size
        key_hash = self.pool.key_hash
        completed = self.completed if self.tiers is not None and tier_ok(extra_keys) else None
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            key = self.block_key(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], extra_keys)
            block_hash = key_hash(key)
            hashes.append(block_hash)
            if self.pool.cache_block(table[i], block_hash, key) and completed is not None:
                completed.append((table[i].block_id, block_hash))

    def reset_prefix_cache(self) -> int:
        """No block computed so far is served again (the model's weights changed, or an operator asked): the pool
        forgets every hash, of blocks in use too; the sequences holding blocks now never register theirs (their KV
        is from before: a preempted one is recomputed and registers again); the KV tiers drop what they hold.
        Returns how many blocks the pool forgot."""
        self.stale.update(self.tables)
        self.completed.clear()
        if self.tiers is not None:
            self.tiers.reset()
        return self.pool.forget_all()

    def take_completed(self) -> list[tuple[int, int]]:
        """The blocks registered since the last call (with KV tiers): what the tiers may store."""
        done, self.completed = self.completed, []
        return done

    # ---- prefix-cache events (kv_events.py) -------------------------------------------------------
    def record_events(self) -> None:
        """From now on, key the prefix cache by the blocks' stable hashes and report blocks registered in and
        evicted from it (``take_events``), and the KV tiers' too. Only while no sequence holds blocks
        (``BlockPool.record_events``)."""
        self.pool.record_events(stable_key_hasher(self.block_size))
        if self.tiers is not None:
            self.tiers.record_events()

    def take_events(self) -> KVCacheEvents | None:
        """The prefix-cache events since the last call, the tiers' in their fields; None when there are none (or
        nobody records them)."""
        events = None if self.pool.events is None else self.pool.events.take()
        tier = self.tiers.take_events() if self.tiers is not None else None
        if tier is not None:
            events = events or KVCacheEvents()
            events.tier_stored, events.tier_removed = tier.stored, tier.removed
        return events

    def cache_snapshot(self) -> KVCacheEvents:
        """Every block the pool and the tiers hold, as events for a new listener."""
        tiered = self.tiers.tiered_hashes() if self.tiers is not None else []
        return KVCacheEvents(self.cached_event_hashes(), reset=True, tier_stored=tiered)

    def cached_event_hashes(self) -> list[int]:
        """The event hashes of every block the prefix cache holds now (a snapshot for a new listener): with
        events on, the pool's keys themselves; none while events are off."""
        return [] if self.pool.events is None else list(self.pool.cached)

    # ---- allocation -------------------------------------------------------------------------------
    def needs_copy_on_write(self, seq_id: str, num_computed: int) -> bool:
        """Whether the next token written (at ``num_computed``) lands in a shared, partly filled block."""
        table = self.tables.get(seq_id)
        idx = num_computed // self.block_size
        return table is not None and idx < len(table) and table[idx].ref_cnt > 1

    def num_blocks_to_allocate(
        self, seq_id: str, num_computed: int, num_new_tokens: int, computed: ComputedBlocks = NO_HITS
    ) -> int:
        """Free blocks that allocate_slots would consume (new blocks, revived cached-free hits, CoW)."""
        table = self.tables.get(seq_id, ())
        hit_blocks = computed[0]
        total = self.num_required_blocks(num_computed + num_new_tokens)
        need = max(0, total - len(table) - len(hit_blocks))
        need += sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_new_tokens > 0 and self.needs_copy_on_write(seq_id, num_computed):
            need += 1
        return need

    def allocate_slots(
        self, seq_id: str, num_computed: int, num_new_tokens: int, computed: ComputedBlocks = NO_HITS
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed`` (which counts the prefix
        hits in ``computed``). Returns the ids of the blocks appended to the table, or None (and changes
        nothing) when there are not enough free blocks. A write into a shared, partly filled block first
        copies it (copy-on-write): the (src, dst) pair is recorded in ``block_copies``."""
        if self.num_blocks_to_allocate(seq_id, num_computed, num_new_tokens, computed) > self.num_free_blocks:
            return None
        table = self.tables.get(seq_id)
        if table is None:
            table = self.tables[seq_id] = []
            self.hashes[seq_id] = []
        hit_blocks, hit_hashes = computed
        if hit_blocks:
            self.pool.touch(hit_blocks)
            table.extend(hit_blocks)
            self.hashes[seq_id].extend(hit_hashes)
        if num_new_tokens > 0 and self.needs_copy_on_write(seq_id, num_computed):
            self._copy_on_write(table, num_computed // self.block_size)
        need = self.num_required_blocks(num_computed + num_new_tokens) - len(table)
        if need <= 0:
            return []
        new_blocks = self.pool.allocate(need)
        table.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def copy_on_write(self, seq_id: str, block_index: int) -> bool:
        """Give ``seq_id`` a private copy of its (shared) block ``block_index``. False if no free block."""
        if self.num_free_blocks < 1:
            return False
        self._copy_on_write(self.tables[seq_id], block_index)
        return True

    def _copy_on_write(self, table: list[KVBlock], idx: int) -> None:
        old = table[idx]
        assert old.ref_cnt > 1 and old.block_hash is None, f"copy-on-write of unshared or full {old}"
        (new,) = self.pool.allocate(1)
        self.block_copies.append((old.block_id, new.block_id))
        table[idx] = new
        self.pool.free((old,))

    def cow_holders(self, seq: Any, table: list[KVBlock] | None, idx: int) -> list[Any]:
        """Copy-on-write for a sequence the worker already holds (``seq``, a scheduler Sequence): its block table
        there cannot change, so the running sequences of its group sharing its partly filled block ``idx`` (fork
        children the worker has not seen yet) get the copies instead, and it keeps writing in place."""
        if table is None or idx >= len(table) or table[idx].ref_cnt == 1:
            return []
        block = table[idx]
        holders = []
        for other in seq.group.seqs:
            if other is seq or other.status is not RequestStatus.RUNNING:
                continue
            other_table = self.tables.get(other.seq_id)
            if other_table is not None and idx < len(other_table) and other_table[idx] is block:
                holders.append(other)
        if len(holders) != block.ref_cnt - 1 or any(h.sent for h in holders):
            raise RuntimeError(f"cannot copy-on-write {block} of {seq}: shared with {holders}")
        return holders

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks (reference counts +1)."""
        table = self.tables[parent_id]
        self.pool.touch(table)
        self.tables[child_id] = list(table)
        self.hashes[child_id] = list(self.hashes[parent_id])
        if parent_id in self.stale:
            self.stale.add(child_id)

    def free(self, seq_id: str, retention: Seq[Retention] = ()) -> None:
        """Drop the sequence's blocks, tail first (its later blocks get evicted before its earlier ones); its cached
        blocks that ``retention`` covers are kept as it asks (retention.py), in the pool and in the tiers."""
        table = self.tables.pop(seq_id, None)
        hashes = self.hashes.pop(seq_id, None) or []
        if table and retention and seq_id not in self.stale:
            self._retain(table, hashes, retention)
        self.stale.discard(seq_id)
        if table:
            self.pool.free(reversed(table))

    def _retain(self, table: list[KVBlock], hashes: list[int], retention: Seq[Retention]) -> None:
        """The hints of a sequence's computed blocks: on the block the pool keeps for each (its own, or the twin
        another sequence registered first), and in the tiers."""
        for i, h in enumerate(hashes):
            priority, duration = block_retention(retention, i, self.block_size)
            if not priority:
                break  # the ranges end before this block
            block = table[i] if table[i].block_hash == h else self.pool.cached.get(h)
            if block is not None:
                self.pool.retain(block, priority, duration)
            if self.tiers is not None:
                self.tiers.retain(h, priority, duration)

    def truncate(self, seq_id: str, num_blocks: int) -> None:
        """Free the sequence's blocks past its first ``num_blocks`` (rejected drafts' slots)."""
        table = self.tables[seq_id]
        if len(table) > num_blocks:
            tail = table[num_blocks:]
            del table[num_blocks:]
            del self.hashes[seq_id][num_blocks:]
            self.pool.free(reversed(tail))

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    # ---- invariants -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for seq_id, table in self.tables.items():
            assert len(self.hashes[seq_id]) <= len(table), f"{seq_id} has more hashes than blocks"
            for block in table:
                refs[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"{block}: ref count {block.ref_cnt} but {refs[block.block_id]} table entries"
            )
        assert set(self.hashes) == set(self.tables), "hash chains and tables disagree"
        assert self.stale <= set(self.tables), "a stale sequence holds no blocks"
