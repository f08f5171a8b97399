"""The router's picture of every engine replica's prefix cache: per replica, the event hashes of the full blocks it
holds (scheduler/kv/kv_events.py), and of those its KV tiers hold below the pool, kept up to date by the
``KVCacheEvents`` each replica sends with its step outputs (cluster/channel/server.py). The picture is a mirror, so
it is as bounded as the replica's cache (``num_blocks`` hashes at most); a replica whose output channel broke or
that was rebuilt starts again from a snapshot.

A prompt is matched by hashing its full blocks in the same chained way the engine does (``prompt_block_hashes``:
with events on, the engine's prefix cache is keyed by these very hashes), from the first block on, and stopping at
the first block no candidate holds: the cost is one blake2b per block of the longest match, plus one. Pure Python
(no ray)."""

from __future__ import annotations

from collections.abc import Sequence

from cbserve.scheduler.kv.kv_events import KVCacheEvents, prompt_block_hashes


class PrefixIndex:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError("num_replicas and block_size must be positive")
        self.block_size = block_size
        self.held: list[set[int]] = [set() for _ in range(num_replicas)]
        self.tiered: list[set[int]] = [set() for _ in range(num_replicas)]  # in its KV tiers (RAM or disk)

    def apply(self, idx: int, events: KVCacheEvents) -> None:
        """Replica ``idx`` stored and evicted these blocks (or, with ``events.reset``, holds exactly these)."""
        events.apply_to(self.held[idx], self.tiered[idx])

    def num_blocks(self, idx: int) -> int:
        return len(self.held[idx])

    def matched_blocks(self, token_ids: Sequence[int], extra_keys: tuple, candidates: Sequence[int]) -> dict[int, int]:
        """For each candidate replica, how many leading full blocks of the prompt its pool holds."""
        return {i: pool for i, (pool, _) in self.matched(token_ids, extra_keys, candidates).items()}

    def matched(self, token_ids: Sequence[int], extra_keys: tuple,
                candidates: Sequence[int]) -> dict[int, tuple[int, int]]:
        """For each candidate replica, how many leading full blocks of the prompt its pool holds, and how many of the
        blocks after those its KV tiers hold (what its engine would serve from the prefix cache, then load from the
        tiers; the last prompt token never is)."""
        held, tiered = self.held, self.tiered
        pool, tier = dict.fromkeys(candidates, 0), dict.fromkeys(candidates, 0)
        alive = [i for i in candidates if held[i] or tiered[i]]
        for n, block_hash in enumerate(prompt_block_hashes(token_ids, self.block_size, extra_keys), 1):
            if not alive:
                break
            still = []
            for i in alive:
                if not tier[i] and block_hash in held[i]:  # the pool's hits come first, then the tiers'
                    pool[i] = n
                elif block_hash in tiered[i]:
                    tier[i] += 1
                else:
                    continue
                still.append(i)
            alive = still
        return {i: (pool[i], tier[i]) for i in candidates}
