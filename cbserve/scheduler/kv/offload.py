"""The KV tiers below the pool, the scheduler's half (connector.py's ``SchedulerConnector``): a RAM tier and a disk
tier, keyed by the prefix cache's block hashes (stable ones: the same in every process and after a restart).

The scheduler owns the index of what each tier holds; the worker's half (worker/kv/tiers.py) holds the bytes
and does what each step's ``KVTransfer`` says, in order, before the forward pass. So a load never misses: the
scheduler offers a block only when the RAM tier holds it, and it evicts from the RAM tier itself.

- Store on completion: a full block the pool registers (its KV computed) is copied to the RAM tier in the next step
  and, with a disk tier, written to disk in the background (write-through). A block already held is only touched.
- Load: a waiting request whose prompt continues past the pool's hits with blocks the RAM tier holds gets them
  copied into fresh pool blocks in the step that admits it; they count as computed, like pool hits.
- Pull (prefill/decode disaggregation, ``remote``: the request's ``KVTransferParams``): a block a producer published
  for the request is pulled from its shared-memory tier into the RAM tier in the background, as a disk block is
  prefetched; a pull that fails marks the (producer, block) unpullable and its tokens are computed.
- Disk: a block only on disk is prefetched into the RAM tier in the background; the request waits (it is not
  admitted) until its blocks arrive or fail (a missing or corrupt file: dropped from the index, the tokens computed).
  The engine loop never waits on disk.
- Eviction: least recently used in each tier; a RAM tier entry evicted stays on disk. Retention hints (retention.py:
  ``retain``, from the pool's manager when a request that asks for them frees its blocks) hold as in the pool: an entry
  with a live hint is passed over while an entry without one can go, and among hinted ones the lowest priority goes
  first; hints cover at most the operator's share of each tier (``RetentionLimits.max_fraction``) and do not survive
  a restart (the disk tier's files do).

Blocks whose request runs a LoRA adapter are not kept in the tiers (an adapter's id is not stable across restarts).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cbserve.scheduler.config import OffloadConfig, RetentionLimits
from cbserve.scheduler.kv.connector import KVTransfer, KVTransferResult
from cbserve.scheduler.kv.kv_events import KVCacheEvents, KVEventRecorder
from cbserve.scheduler.requests.kv_transfer import KVTransferParams

DISK_SUFFIX = ".kv"


@dataclass
class OffloadStats:
    """Counters since the engine started (``/stats``, the metrics)."""

    hit_tokens_ram: int = 0  # prompt tokens loaded from the RAM tier
    hit_tokens_disk: int = 0  # of those, tokens whose blocks were prefetched from disk
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_prefetched: int = 0
    prefetch_failures: int = 0  # missing, truncated or corrupt files
    evictions_ram: int = 0
    evictions_disk: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    bytes_from_disk: int = 0
    store_s: float = 0.0
    load_s: float = 0.0
    # prefill/decode disaggregation: blocks pulled from producers' shared tiers, their prompt tokens loaded
    blocks_pulled: int = 0
    pull_failures: int = 0  # a producer gone, its block overwritten or never published in time: computed here
    hit_tokens_remote: int = 0
    bytes_pulled: int = 0
    bytes_pulled_ray: int = 0  # of those, through the Ray object store (a producer on another node)
    pull_s: float = 0.0


def tier_ok(extra_keys: tuple) -> bool:
    """Whether a request's blocks may go to the tiers: not with a LoRA adapter (see the module docstring)."""
    return not any(isinstance(k, tuple) and k[:1] == ("lora",) for k in extra_keys)


def disk_names(disk_dir: str) -> dict[int, os.DirEntry[str]]:
    """The block files in ``disk_dir`` by hash (none when the folder is missing)."""
    out = {}
    try:
        with os.scandir(disk_dir) as it:
            for e in it:
                if e.name.endswith(DISK_SUFFIX):
                    try:
                        out[int(e.name[: -len(DISK_SUFFIX)], 16)] = e
                    except ValueError:
                        continue
    except FileNotFoundError:
        pass
    return out


def oldest_first(entries: dict[int, os.DirEntry[str]]) -> list[int]:
    """The hashes of ``entries`` by their files' age, oldest first; a file deleted meanwhile (by a replica sharing
    the folder) is left out."""
    times = {}
    for h, e in entries.items():
        try:
            times[h] = e.stat().st_mtime_ns
        except OSError:
            continue
    return sorted(times, key=times.__getitem__)


def scan_disk(disk_dir: str) -> list[int]:
    """The block hashes of the files in ``disk_dir``, oldest first."""
    return oldest_first(disk_names(disk_dir))


@dataclass
class _Pending:
    stores: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    prefetch: list[int] = field(default_factory=list)
    disk_evict: list[int] = field(default_factory=list)
    pulls: list[tuple[int, str]] = field(default_factory=list)


class OffloadConnector:
    def __init__(self, config: OffloadConfig, block_size: int,
                 block_hash: Callable[[int | None, Sequence[int], tuple], int],
                 retention: RetentionLimits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``block_hash(parent, tokens, extra_keys)``: the pool's (stable) hash of a full block."""
        self.config = config
        self.clock = clock
        self.retained: dict[int, tuple[int, float]] = {}  # hash -> (priority, until): hints the tiers honour
        self.retain_share = retention.max_fraction if retention is not None else 0.0
        self.block_size = block_size
        self.block_hash = block_hash
        self.ram: OrderedDict[int, bool] = OrderedDict()  # hash -> ready (False: prefetch from disk under way)
        self.prefetching = 0  # entries of ``ram`` not ready
        self.disk: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recently used first
        self.from_disk: set[int] = set()  # RAM tier entries that came from disk (for the hit counters)
        self.pulling: dict[int, str] = {}  # RAM tier entries on their way from a producer: hash -> producer
        self.from_remote: set[int] = set()  # pulled entries not loaded yet (for the hit counters)
        self.unpullable: OrderedDict[tuple[str, int], None] = OrderedDict()  # (producer, hash) pulls that failed
        self.stats = OffloadStats()
        self.events: KVEventRecorder | None = None  # which blocks the tiers hold, for a router (``record_events``)
        self._next = _Pending()
        if config.disk_dir is not None:
            for h in scan_disk(config.disk_dir):  # a restarted replica warms from what is there
                self.disk[h] = None
            self._trim_disk()

    # ---- admission --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, token_ids: Sequence[int], extra_keys: tuple, parent: int | None,
                                   num_cached_blocks: int, remote: KVTransferParams | None = None
                                   ) -> tuple[list[int], bool]:
        if not tier_ok(extra_keys):
            return [], False
        bs = self.block_size
        ready: list[int] = []
        wait = False
        last = min((len(token_ids) - 1) // bs, num_cached_blocks + max(1, self.config.ram_blocks // 2))
        for i in range(num_cached_blocks, last):  # the last token is always computed; half the tier at most
            h = self.block_hash(parent, token_ids[i * bs : (i + 1) * bs], extra_keys)
            state = self.ram.get(h)
            if state is None and (h in self.disk and self._prefetch(h)
                                  or remote is not None and i < remote.remote_blocks and self._pull(h, remote)):
                state = False  # on its way from disk, or from the producer that prefilled the request
            if state is None:
                break
            if not state:
                wait = True  # on its way from disk: prefetch what follows too, load nothing yet
            else:
                self.ram.move_to_end(h)  # wanted: not evicted while the rest of the prompt arrives
                if not wait:
                    ready.append(h)
            parent = h
        return ready, wait

    def update_state_after_alloc(self, blocks: list[tuple[int, int]]) -> None:
        for block_id, h in blocks:
            self.ram.move_to_end(h)
            self._next.loads.append((block_id, h))
            self.stats.hit_tokens_ram += self.block_size
            self.stats.hit_tokens_disk += self.block_size if h in self.from_disk else 0
            if h in self.from_remote:
                self.from_remote.discard(h)
                self.stats.hit_tokens_remote += self.block_size
        self.stats.blocks_loaded += len(blocks)

    # ---- each step ----------------------------------------------------------------------------------
    def build_connector_meta(self, completed: list[tuple[int, int]]) -> KVTransfer | None:
        for block_id, h in completed:
            if h in self.ram:
                self.ram.move_to_end(h)
                continue
            if not self._make_room():
                continue  # every entry is on its way from disk or loaded this step: this block is not kept
            self._tier_in(h)
            self.ram[h] = True  # stored before any later step's load (the worker runs the steps in order)
            self._next.stores.append((block_id, h))
            self.stats.blocks_stored += 1
        p, self._next = self._next, _Pending()
        transfer = KVTransfer(p.stores, p.loads, p.evict, p.prefetch, p.disk_evict, self.prefetching > 0, p.pulls)
        return transfer if transfer else None

    def update_connector_output(self, result: KVTransferResult) -> None:
        for h in result.on_disk:
            self._tier_in(h)
            self.disk[h] = None
            self.disk.move_to_end(h)
        for h in result.off_disk:  # another replica deleted it: forgotten here, nothing to delete
            if self.disk.pop(h, None) is not None:
                self._tier_out(h)
        self._trim_disk()
        pulled = {h for h in result.pulled if self.pulling.pop(h, None) is not None}
        pull_failures = 0
        for h in result.prefetched:
            if self.ram.get(h) is False:
                self.ram[h] = True
                self.prefetching -= 1
                (self.from_remote if h in pulled else self.from_disk).add(h)
        for h in result.failed:  # never served: dropped (the worker deleted its file), its tokens computed
            producer = self.pulling.pop(h, None)
            if producer is not None:
                self._unpullable(producer, h)
                pull_failures += 1
            ready = self.ram.pop(h, None)
            if ready is False:
                self.prefetching -= 1
            if ready is not None:
                self._next.evict.append(h)  # the worker frees the slot it held for it
            self.disk.pop(h, None)
            self._tier_out(h)
        s = self.stats
        s.blocks_pulled += len(pulled)
        s.blocks_prefetched += len(result.prefetched) - len(pulled)
        s.pull_failures += pull_failures
        s.prefetch_failures += len(result.failed) - pull_failures
        s.bytes_pulled += result.bytes_pulled
        s.bytes_pulled_ray += result.bytes_pulled_ray
        s.pull_s += result.pull_s
        s.bytes_stored += result.bytes_stored
        s.bytes_loaded += result.bytes_loaded
        s.bytes_from_disk += result.bytes_from_disk
        s.store_s += result.store_s
        s.load_s += result.load_s

    def steps_dropped(self, transfers: list[KVTransfer]) -> None:
        """A dropped step's stores may not have happened: forget them (and drop whatever the worker holds of them);
        its evictions and prefetches are asked again; its loads went to requests that are recomputed."""
        for t in transfers:
            for _, h in t.stores:
                if self.ram.pop(h, None) is not None:
                    self._next.evict.append(h)
                    self._tier_out(h)
            self._next.evict.extend(t.evict)
            self._next.disk_evict.extend(t.disk_evict)
            # asked again (a second read of one that did start is harmless); else its request would wait for good
            self._next.prefetch.extend(h for h in t.prefetch if self.ram.get(h) is False)
            self._next.pulls.extend((h, p) for h, p in t.pulls if self.ram.get(h) is False)

    def reset(self) -> None:
        """Drop every block the tiers hold (the worker frees their RAM slots and deletes their files); an entry on its
        way from disk stays until it arrives (a prefetch cannot be called back)."""
        for h in [h for h, ready in self.ram.items() if ready]:
            del self.ram[h]
            self.from_disk.discard(h)
            self._next.evict.append(h)
            self._tier_out(h)
        self._next.disk_evict.extend(self.disk)
        for h in list(self.disk):
            del self.disk[h]
            self._tier_out(h)
        self.retained.clear()

    def request_finished(self, seq_id: str, block_ids: list[int]) -> bool:
        return False  # the tiers hold copies: the pool's blocks are free at once

    # ---- events: which blocks the tiers hold (kv_events.py's tier fields) --------------------------
    def record_events(self) -> None:
        self.events = KVEventRecorder()
        for h in self.tiered_hashes():  # what the disk tier held at start: a router scores it at once
            self.events.store(h)

    def tiered_hashes(self) -> list[int]:
        return list(self.ram.keys() | self.disk.keys())

    def take_events(self) -> KVCacheEvents | None:
        """The blocks that came into the tiers (``stored``) and left both (``removed``) since the last call."""
        return None if self.events is None else self.events.take()

    def _tier_in(self, h: int) -> None:
        """Before ``h`` goes into a tier: an event when neither held it."""
        if self.events is not None and h not in self.ram and h not in self.disk:
            self.events.store(h)

    def _tier_out(self, h: int) -> None:
        if h not in self.ram and h not in self.disk:
            self.retained.pop(h, None)
            if self.events is not None:
                self.events.remove(h)

    # ---- capacity -----------------------------------------------------------------------------------
    def _prefetch(self, h: int) -> bool:
        """Ask for ``h`` from disk; False when the RAM tier has no room for it now (half of it at most is on its way
        from disk at once)."""
        if self.prefetching >= max(1, self.config.ram_blocks // 2) or not self._make_room():
            return False
        self.ram[h] = False
        self.prefetching += 1
        self.disk.move_to_end(h)
        self._next.prefetch.append(h)
        return True

    def _pull(self, h: int, remote: KVTransferParams) -> bool:
        """Ask for ``h`` from the producer ``remote`` names, as ``_prefetch`` asks the disk; False when it failed before
        or the RAM tier has no room for it now."""
        producer = remote.remote_engine
        if (producer, h) in self.unpullable or self.prefetching >= max(1, self.config.ram_blocks // 2) or \
                not self._make_room():  # fmt: skip
            return False
        self.ram[h] = False
        self.prefetching += 1
        self.pulling[h] = producer
        self._next.pulls.append((h, producer))
        return True

    def _unpullable(self, producer: str, h: int) -> None:
        self.unpullable[(producer, h)] = None
        while len(self.unpullable) > 4 * self.config.ram_blocks + 64:
            self.unpullable.popitem(last=False)

    def retain(self, h: int, priority: int, duration_s: float) -> None:
        """A retention hint for block ``h`` from now on (the higher and longer of it and a live one)."""
        now = self.clock()
        old = self.retained.get(h)
        if old is None or old[1] <= now:
            self.retained[h] = (priority, now + duration_s)
        else:
            self.retained[h] = (max(old[0], priority), max(old[1], now + duration_s))
        if len(self.retained) > 2 * (self.config.ram_blocks + self.config.disk_blocks) + 64:
            self.retained = {k: v for k, v in self.retained.items() if v[1] > now and (k in self.ram or k in self.disk)}

    def _victim(self, tier: OrderedDict[int, Any], entries: Iterable[int], capacity: int) -> int | None:
        """The entry of ``tier`` to evict: the least recently used one without a live hint; past the hints' share of
        the tier (or with none left unhinted), the lowest priority among the hinted ones passed over. Those passed
        over move to the tier's tail, so the next eviction does not walk them again."""
        now, passed, limit = self.clock(), [], int(capacity * self.retain_share)
        victim = None
        for h in entries:
            hint = self.retained.get(h)
            if hint is None or hint[1] <= now:
                victim = h
                break
            passed.append((hint[0], h))
            if len(passed) > limit:
                break
        if victim is None and passed:
            victim = min(passed)[1]
        for _, h in passed:
            if h != victim:
                tier.move_to_end(h)
        return victim

    def _make_room(self) -> bool:
        """Room for one more RAM tier entry, evicting the least recently used one that is neither on its way from
        disk nor loaded by this step (the worker evicts before it stores and loads), hints honoured (``_victim``);
        False when there is none."""
        loading = {h for _, h in self._next.loads} if len(self.ram) >= self.config.ram_blocks else set()
        while len(self.ram) >= self.config.ram_blocks:
            candidates = (h for h, ready in self.ram.items() if ready and h not in loading)
            victim = self._victim(self.ram, candidates, self.config.ram_blocks)
            if victim is None:
                return False
            del self.ram[victim]
            self.from_disk.discard(victim)
            self._next.evict.append(victim)
            self._tier_out(victim)
            self.stats.evictions_ram += 1
        return True

    def _trim_disk(self) -> None:
        while len(self.disk) > self.config.disk_blocks:
            h = self._victim(self.disk, iter(self.disk), self.config.disk_blocks)
            assert h is not None  # the disk tier is not empty
            del self.disk[h]
            self._next.disk_evict.append(h)
            self._tier_out(h)
            self.stats.evictions_disk += 1
