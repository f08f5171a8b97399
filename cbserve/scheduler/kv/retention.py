"""Retention hints in the pool: a request may ask to keep the KV of ranges of its prompt cached for a while, at a
priority (its ranges: requests/retention.py; ``retention_directives``, as vLLM's retention proposal and
TensorRT-LLM's token-range retention; ``cache_control`` on a chat message, as Anthropic's API, is one such range:
the conversation up to that message).

A block gets the highest priority and the longest duration among the ranges that end after its first token (a range's
earlier blocks too: a prefix cache hits a block only with every block before it), for that duration from the moment
its last holder frees it (each use renews it, as a prompt cache's TTL). A free cached block with a
live retention waits in ``RetainedBlocks`` instead of the pool's LRU queue: an allocation takes every ordinary free
block first, then retained ones, lowest priority first (least recently freed first within a priority), so a flood of
conversations without hints (or with lower ones) never evicts a retained prefix while it can evict anything else.
It is a soft rule: a retained block is still evicted rather than refusing an allocation. When its time passes, a
block rejoins the LRU queue at its head (it was freed long ago). The operator's limits (config.py's
``RetentionLimits``): the longest duration a request may ask, and the share of the pool retained blocks may hold
(past it, the lowest priority, least recently freed retained block returns to the LRU queue); a share of 0 turns
hints off (requests that carry them are refused). The KV tiers below the pool honour the same hints (offload.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Protocol


class Retainable(Protocol):
    block_id: int
    retain_priority: int  # 0: none
    retain_duration: float
    retain_until: float  # the clock's time it ends


class RetainedBlocks:
    """Free cached blocks with a live retention, by priority; each block carries ``retain_priority`` (> 0 while it
    is here) and ``retain_until``. ``clock``: the pool's. Blocks need ``block_id``."""

    def __init__(self, capacity: int, clock: Callable[[], float]) -> None:
        self.capacity = capacity  # the most blocks held (the operator's share of the pool)
        self.clock = clock
        # priority -> {block_id: block}, least recently freed first
        self.by_priority: dict[int, dict[int, Retainable]] = {}
        self.expiry: list[tuple[float, int, int, Retainable]] = []  # (until, tie, block_id, block); lazily deleted
        self._tie = itertools.count()
        self.num = 0

    def __len__(self) -> int:
        return self.num

    def __iter__(self) -> Iterator[Retainable]:
        for blocks in self.by_priority.values():
            yield from blocks.values()

    def add(self, block: Retainable) -> Retainable | None:
        """Hold ``block`` (its retention live); the block pushed out past ``capacity`` (to go to the LRU queue), if
        any: the lowest priority, least recently freed one, which may be ``block`` itself."""
        p = block.retain_priority
        self.by_priority.setdefault(p, {})[block.block_id] = block
        self.num += 1
        heapq.heappush(self.expiry, (block.retain_until, next(self._tie), block.block_id, block))
        if len(self.expiry) > 4 * max(16, self.num):
            self._compact()
        return self.pop_lowest() if self.num > self.capacity else None

    def remove(self, block: Retainable) -> None:
        """Take ``block`` out (revived by a hit: it keeps its retention for when it is freed again)."""
        blocks = self.by_priority[block.retain_priority]
        del blocks[block.block_id]
        if not blocks:
            del self.by_priority[block.retain_priority]
        self.num -= 1

    def pop_lowest(self) -> Retainable:
        """The lowest priority, least recently freed block, taken out and its retention dropped."""
        p = min(self.by_priority)
        block = next(iter(self.by_priority[p].values()))
        self.remove(block)
        block.retain_priority, block.retain_duration, block.retain_until = 0, 0.0, 0.0
        return block

    def expired(self) -> list[Retainable]:
        """The blocks whose time passed, taken out (oldest expiry first)."""
        now, out = self.clock(), []
        while self.expiry and self.expiry[0][0] <= now:
            until, _, _, block = heapq.heappop(self.expiry)
            if block.retain_until == until and self.holds(block):
                self.remove(block)
                block.retain_priority, block.retain_duration, block.retain_until = 0, 0.0, 0.0
                out.append(block)
        return out

    def holds(self, block: Retainable) -> bool:
        blocks = self.by_priority.get(block.retain_priority) if block.retain_priority > 0 else None
        return blocks is not None and blocks.get(block.block_id) is block

    def _compact(self) -> None:
        self.expiry = [e for e in self.expiry if e[3].retain_until == e[0] and self.holds(e[3])]
        heapq.heapify(self.expiry)
