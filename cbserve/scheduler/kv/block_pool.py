"""The logical KV block pool: every block preallocated, a free queue with O(1) removal from the middle,
LRU eviction of freed prefix-cached blocks, and the hash table ``block_hash -> block``.

A block is *used* while ``ref_cnt > 0`` and *free* (in the free queue) when ``ref_cnt == 0``. A free
block may still carry a ``block_hash``: its KV stays valid and a prefix-cache hit can revive it (it is
unlinked from the middle of the queue) until an allocation takes it from the head and evicts its hash.
Freed blocks are appended at the tail, so the least recently freed cached block is evicted first.

A freed cached block with a live retention hint (``retain``: retention.py) waits in ``retained`` instead, evicted
only once the queue is empty, lowest priority first; its time passed, it rejoins the queue at its head.

Blocks are keyed by ``key_hash(block_key)``: Python's ``hash`` (fast, but salted per process), or, once
``record_events`` was called, a stable hash (kv_events.py's ``stable_key_hasher``: blake2b, the same in every
process). Then the pool reports each block registered as stored and each one evicted as removed (``events``, a
``KVEventRecorder``), named by its key hash itself: the hash a router computes for the same tokens
(``prompt_block_hashes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from cbserve.scheduler.config import RetentionLimits
from cbserve.scheduler.kv.kv_events import KVEventRecorder
from cbserve.scheduler.kv.retention import RetainedBlocks

BlockKey = tuple  # (parent block hash | None, token ids of the full block, extra keys)


class KVBlock:
    """One logical KV block. ``prev_free``/``next_free`` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "prev_free", "next_free", "retain_priority",
                 "retain_duration", "retain_until")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.retain_priority = 0  # a retention hint's (retention.py): 0 none
        self.retain_duration = 0.0  # how long it holds once the block is free (each release renews it)
        self.retain_until = 0.0  # set at release: then + the duration
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.block_key: BlockKey | None = None  # what the hash was computed from: confirms a hit
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels. All operations are O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free = last
        block.next_free = self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next_free
        assert first is not None
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self._head.next_free = block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, retention: RetentionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.clock = clock
        share = retention.max_fraction if retention is not None and enable_caching else 0.0
        self.retained = RetainedBlocks(int(num_blocks * share), clock)  # free cached blocks with live hints
        self.num_retained_evictions = 0  # retained blocks evicted before their time (nothing else was free)
        self.cached: dict[int, KVBlock] = {}  # block_hash -> block (used or free)
        self.num_evictions = 0
        self.events: KVEventRecorder | None = None  # prefix-cache events, when someone listens
        self.key_hash: Callable[[BlockKey], int] = hash  # block key -> its hash in ``cached``

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free + self.retained.num

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, num: int) -> list[KVBlock]:
        """Take ``num`` blocks from the head of the free queue (evicting their cached hashes)."""
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks, only {self.num_free_blocks} free")
        if self.retained.num:
            self._demote_expired()
        out = []
        for _ in range(num):
            if self.free_queue.num_free:
                block = self.free_queue.popleft()
            else:  # only retained blocks are free: the lowest priority goes (a hint is soft)
                block = self.retained.pop_lowest()  # type: ignore[assignment]
                self.num_retained_evictions += 1
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks (prefix-cache hit or fork); a free one is revived from the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unfree(block)
            block.ref_cnt += 1

    def _unfree(self, block: KVBlock) -> None:
        if self.retained.num and self.retained.holds(block):
            self.retained.remove(block)
        else:
            self.free_queue.remove(block)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the given order; blocks reaching 0 go to the queue's tail.
        Pass a request's blocks tail first so that its later blocks are evicted before its earlier ones."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._release(block)

    def _release(self, block: KVBlock) -> None:
        if block.retain_priority and block.block_hash is not None:
            block.retain_until = max(block.retain_until, self.clock() + block.retain_duration)  # each use renews it
            if self.retained.num:
                self._demote_expired()  # before the share is counted
            pushed = self.retained.add(block)  # past the operator's share: the lowest one loses its hint
            if pushed is not None:
                self.free_queue.appendleft(pushed)  # type: ignore[arg-type]  # (the least recently freed)
            return
        block.retain_priority, block.retain_duration, block.retain_until = 0, 0.0, 0.0
        self.free_queue.append(block)

    def _demote_expired(self) -> None:
        """Blocks whose hint ran out rejoin the LRU queue at its head (the longest expired first to go)."""
        for block in reversed(self.retained.expired()):
            self.free_queue.appendleft(block)  # type: ignore[arg-type]

    def retain(self, block: KVBlock, priority: int, duration_s: float) -> None:
        """A retention hint for a cached block: the higher priority and the longer duration of it and the block's
        own, counted from the block's release (a free block's from now)."""
        free = block.ref_cnt == 0
        if free:
            self._unfree(block)
        block.retain_priority = max(block.retain_priority, priority)
        block.retain_duration = max(block.retain_duration, duration_s)
        if free:
            self._release(block)

    # ---- prefix cache -----------------------------------------------------------------------------
    def get_cached_block(self, block_hash: int, block_key: BlockKey) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.block_key != block_key:  # a hash collision is a miss
            return None
        return block

    def cache_block(self, block: KVBlock, block_hash: int, block_key: BlockKey) -> bool:
        """Register a full, computed block (``block_hash``: ``key_hash(block_key)``; reported to ``events``). If
        another block already holds this content, keep that one. Whether ``block`` was registered."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.block_key = block_key
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.store(block_hash)
        return True

    def record_events(self, key_hash: Callable[[BlockKey], int]) -> KVEventRecorder:
        """From now on, key blocks by ``key_hash`` (their stable hash) and report each block registered and evicted
        by it. Blocks cached under the per-process hash are forgotten first; none may be in use then. Idempotent:
        once events are on, the key hash stays."""
        if self.events is None:
            if not self.reset_prefix_cache():
                raise RuntimeError("prefix-cache events must be turned on while no block is in use")
            self.key_hash = key_hash
            self.events = KVEventRecorder()
            self.events.reset_to(())  # a new listener's snapshot: the cache is empty
        return self.events

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:  # type: ignore[arg-type]
            del self.cached[block.block_hash]  # type: ignore[arg-type]
        self._forget(block)
        self.num_evictions += 1

    def _forget(self, block: KVBlock) -> None:
        if self.events is not None:
            self.events.remove(block.block_hash)  # type: ignore[arg-type]
        block.block_hash = block.block_key = None
        block.retain_priority, block.retain_duration, block.retain_until = 0, 0.0, 0.0

    def _release_retained(self) -> None:
        """Every retained block back to the queue (their hashes are about to be forgotten)."""
        for block in list(self.retained):
            self.retained.remove(block)
            self.free_queue.append(block)  # type: ignore[arg-type]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._release_retained()
        for block in self.cached.values():
            self._forget(block)
        self.cached.clear()
        return True

    def forget_all(self) -> int:
        """Forget every cached hash, of blocks in use too (their KV is never served again: the weights changed).
        Returns how many."""
        n = len(self.cached)
        self._release_retained()
        for block in self.cached.values():
            self._forget(block)
        self.cached.clear()
        return n

    # ---- invariants -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        in_queue = set()
        for block in (*self.free_queue, *self.retained):
            assert block.ref_cnt == 0, f"{block} is in the free queue with references"
            assert block.block_id not in in_queue, f"{block} is twice in the free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.num_free_blocks, "free queue length is off"
        for block in self.retained:
            assert block.retain_priority > 0 and block.block_hash is not None, f"{block} is retained without a hint"
        assert self.retained.num <= self.retained.capacity, "more retained blocks than the operator's share"
        num_used = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt > 0:
                num_used += 1
                assert block.block_id not in in_queue, f"used {block} is in the free queue"
            else:
                assert block.block_id in in_queue, f"free {block} is not in the free queue"
        assert num_used + len(in_queue) == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash table entry {block_hash} points to {block}"
            assert block.block_key is not None and self.key_hash(block.block_key) == block_hash
