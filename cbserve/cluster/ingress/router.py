"""Data-parallel routing: pick the engine replica for a request by load with prefix affinity.

Load is the number of outstanding tokens (prompt + tokens still to generate) of the requests this router
sent to a replica and that have not finished. Prefix affinity: the first block-aligned chunk of the prompt
(up to ``affinity_tokens`` tokens) is hashed and mapped to a preferred replica by rendezvous hashing over the
healthy replicas, so requests sharing a prefix land where that prefix is cached. The preferred replica is
used unless it has more than ``max_imbalance_tokens`` more outstanding tokens than the least loaded one.

LoRA adapter affinity: each replica remembers the last ``adapter_memory`` adapters it was sent (what its
workers keep loaded, ``max_cpu_loras``). A request for an adapter goes to the least loaded replica that has it,
within the same imbalance bound; otherwise to the adapter's own replica by rendezvous hashing of its id (not of
the prompt), so an adapter's requests gather on one replica instead of loading it everywhere.

Modes (``routing``): ``cache_aware`` (the default) first looks at what each replica's prefix cache really holds
(cluster/ingress/prefix_index.py, fed by the replicas' block events). When some replica within the imbalance bound
of the least loaded one holds a cached prefix of the prompt (in whole blocks; it counts when it covers the affinity
chunk, or every cacheable block of a shorter prompt), the request goes to the replica of that bound where its first
token should come soonest: the fewest prompt tokens to prefill ahead of it (those of the requests routed there that have
no token yet) plus its own uncached ones (counted twice, for the cache room they take); with no prefill waiting
anywhere that is the longest cached prefix (then more cached blocks, then the less loaded). With no such hit, the
rules above apply. So a tenant's prompts follow its cache where the cache went (a spill past the bound, a rebuilt
or added replica) unless prefilling the prompt elsewhere beats the queue of prefills there, and never pile onto
one replica for a chat template's block.
``affinity`` is the rules above alone; ``round_robin`` takes the healthy replicas in turn (a baseline). Every
decision is counted by kind (``RoutingStats``, exported by cluster/ops/metrics.py).
Pure Python (no ray): the ingress owns one Router and tells it which replicas are healthy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cbserve.cluster.ingress.prefix_index import PrefixIndex
from cbserve.config import ROUTING_MODES
from cbserve.scheduler.kv.kv_events import KVCacheEvents


@dataclass
class RoutingStats:
    """A router's decisions since the last ``Router.take_stats``: the number of each kind, and (cache_aware) how
    many prompt tokens the chosen replica held cached, as length -> number of requests (bounded by the lengths)."""

    decisions: dict[str, int] = field(default_factory=dict)
    matched_tokens: dict[int, int] = field(default_factory=dict)
    disaggregation: dict[str, int] = field(default_factory=dict)  # a P:D app's prefills by where (disaggregation.py)


@dataclass(frozen=True)
class Route:
    """A routing decision: the replica, and the prompt tokens it is expected to prefill for the request (its
    uncached ones as the router sees the replica's cache)."""

    replica: int
    prefill_tokens: int


class NoHealthyReplicaError(RuntimeError):
    """Every engine replica is down or still starting (HTTP 503)."""


@dataclass
class ReplicaState:
    outstanding_tokens: int = 0
    num_requests: int = 0  # in flight
    total_routed: int = 0
    cache_hits: int = 0  # requests sent here for the prefix its cache holds
    healthy: bool = False
    pending_prefill_tokens: int = 0  # uncached prompt tokens of the requests routed here that have no token yet
    adapters: OrderedDict[int, None] = field(default_factory=OrderedDict)  # recently sent adapter ids, oldest first


class Router:
    def __init__(
        self, num_replicas: int, block_size: int, affinity_tokens: int = 64, max_imbalance_tokens: int = 4096,
        adapter_memory: int = 1, mode: str = "cache_aware",
    ) -> None:
        if num_replicas < 1 or block_size < 1 or adapter_memory < 1:
            raise ValueError("num_replicas, block_size and adapter_memory must be positive")
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {', '.join(ROUTING_MODES)}")
        self.mode = mode
        self.index = PrefixIndex(num_replicas, block_size)
        self.stats = RoutingStats()
        self.block_size = block_size
        self.affinity_tokens = affinity_tokens
        self.max_imbalance_tokens = max_imbalance_tokens
        self.adapter_memory = adapter_memory
        self.replicas = [ReplicaState() for _ in range(num_replicas)]
        self._next = 0  # round-robin tie break among equally loaded replicas
        self._turn = 0  # round_robin mode's next turn

    # ---- health and load ------------------------------------------------------------------
    def set_healthy(self, idx: int, healthy: bool) -> None:
        self.replicas[idx].healthy = healthy

    def healthy_replicas(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.healthy]

    def add(self, idx: int, tokens: int, lora_id: int | None = None, prefill_tokens: int = 0) -> None:
        """A request of ``tokens`` outstanding tokens (with adapter ``lora_id``, if any; ``prefill_tokens`` of its
        prompt to prefill there, until ``prefilled``) went to replica ``idx``."""
        r = self.replicas[idx]
        r.outstanding_tokens += tokens
        r.pending_prefill_tokens += prefill_tokens
        r.num_requests += 1
        r.total_routed += 1
        if lora_id is not None:
            r.adapters[lora_id] = None
            r.adapters.move_to_end(lora_id)
            while len(r.adapters) > self.adapter_memory:
                r.adapters.popitem(last=False)

    def place(self, prompt_token_ids: Sequence[int], tokens: int, exclude: Collection[int] = (),
              lora_id: int | None = None, extra_keys: tuple = ()) -> Route:
        """``route`` a request of ``tokens`` outstanding tokens and ``add`` it to the replica chosen."""
        route = self.route(prompt_token_ids, exclude, lora_id, extra_keys)
        self.add(route.replica, tokens, lora_id, route.prefill_tokens)
        return route

    def prefilled(self, idx: int, prefill_tokens: int) -> None:
        """The request ``add`` counted with ``prefill_tokens`` has its first token (or ended)."""
        r = self.replicas[idx]
        r.pending_prefill_tokens = max(0, r.pending_prefill_tokens - prefill_tokens)

    def done(self, idx: int, tokens: int) -> None:
        r = self.replicas[idx]
        r.outstanding_tokens = max(0, r.outstanding_tokens - tokens)
        r.num_requests = max(0, r.num_requests - 1)

    # ---- prefix caches and stats -------------------------------------------------------------
    def apply_cache_events(self, idx: int, events: KVCacheEvents) -> None:
        """Replica ``idx``'s prefix cache changed (its step frames carry the events)."""
        self.index.apply(idx, events)

    def take_stats(self) -> RoutingStats:
        stats, self.stats = self.stats, RoutingStats()
        return stats

    def _decided(self, idx: int, kind: str, matched_tokens: int | None = None) -> int:
        decisions = self.stats.decisions
        decisions[kind] = decisions.get(kind, 0) + 1
        if matched_tokens is not None:
            lengths = self.stats.matched_tokens
            lengths[matched_tokens] = lengths.get(matched_tokens, 0) + 1
        if kind == "cache_hit":
            self.replicas[idx].cache_hits += 1
        return idx

    # ---- the choice -----------------------------------------------------------------------
    def prefix_key(self, prompt_token_ids: Sequence[int]) -> bytes | None:
        """Hash of the first block-aligned chunk of the prompt; None when the prompt is shorter than a
        block (nothing cacheable to be affine to). The last prompt token is never cached, so excluded."""
        n = min(self.affinity_tokens, len(prompt_token_ids) - 1)
        n -= n % self.block_size
        if n <= 0:
            return None
        data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in prompt_token_ids[:n])
        return hashlib.blake2b(data, digest_size=16).digest()

    def preferred(self, key: bytes, candidates: Sequence[int]) -> int:
        """Rendezvous (highest random weight) hashing: stable when replicas come and go."""

        def score(idx: int) -> bytes:
            return hashlib.blake2b(key + idx.to_bytes(4, "little"), digest_size=8).digest()

        return max(candidates, key=score)

    def choose(
        self, prompt_token_ids: Sequence[int], exclude: Collection[int] = (), lora_id: int | None = None,
        extra_keys: tuple = (),
    ) -> int:
        """The replica ``route`` picks."""
        return self.route(prompt_token_ids, exclude, lora_id, extra_keys).replica

    def route(
        self, prompt_token_ids: Sequence[int], exclude: Collection[int] = (), lora_id: int | None = None,
        extra_keys: tuple = (),
    ) -> Route:
        """The replica for a request (with adapter ``lora_id``, if any, and its prefix-cache ``extra_keys``:
        scheduler/kv/kv_events.py's ``cache_extra_keys``); ``exclude``: replicas that already turned it away."""
        healthy = [i for i in self.healthy_replicas() if i not in exclude]
        if not healthy:
            raise NoHealthyReplicaError("no engine replica is ready" if not exclude else "every ready replica is full")
        n = len(prompt_token_ids)
        if self.mode == "round_robin":
            self._turn += 1
            return Route(self._decided(healthy[self._turn % len(healthy)], "round_robin"), n)
        least = self._least_loaded(healthy)
        if self.mode == "cache_aware":
            found = self.index.matched(prompt_token_ids, extra_keys, healthy)  # (pool, tier) blocks
            matched = {i: pool + tier for i, (pool, tier) in found.items()}
            within = [i for i in healthy if self._within_bound(i, least)]
            min_hit = self._min_hit_blocks(n)
            if any(matched[i] >= min_hit for i in within):
                best = min(within, key=lambda i: self._first_token_cost(i, n, *found[i]))
                kind = "cache_hit" if matched[best] >= min_hit else "least_loaded"
                return Route(self._decided(best, kind, matched[best] * self.block_size),
                             n - matched[best] * self.block_size)  # fmt: skip
            idx, kind = self._by_affinity(prompt_token_ids, healthy, least, lora_id)
            return Route(self._decided(idx, kind, 0), n - matched.get(idx, 0) * self.block_size)
        idx, kind = self._by_affinity(prompt_token_ids, healthy, least, lora_id)
        return Route(self._decided(idx, kind), n)

    def _first_token_cost(self, idx: int, num_prompt_tokens: int, pool_blocks: int,
                          tier_blocks: int = 0) -> tuple[int, int, int]:
        """How soon replica ``idx`` should give a request its first token, lower first: the prompt tokens to
        prefill there before it and its own uncached ones, these counted twice (prefilling them also takes cache
        room that other prompts held, which later requests pay for: counted once, the spills cost 8 points of
        hit rate in bench_routing.py for no better TTFT), and its tokens in the KV tiers at an eighth of that (a
        load from the RAM tier is about a tenth of a prefill on CPU: bench_kv_tiers.py), so that a tiered hit
        scores below a pool hit and above a miss; then fewer cached blocks, then more outstanding tokens."""
        r = self.replicas[idx]
        bs = self.block_size
        uncached = num_prompt_tokens - (pool_blocks + tier_blocks) * bs
        loaded = tier_blocks * bs
        cost = r.pending_prefill_tokens + 2 * uncached + loaded // 4
        return cost, -(pool_blocks + tier_blocks), r.outstanding_tokens

    def _min_hit_blocks(self, num_prompt_tokens: int) -> int:
        """The shortest cached prefix (blocks) that counts as a hit: the affinity chunk, or the prompt's cacheable
        blocks when fewer. A shorter one is what every request of a chat template shares; it would pull all of
        them onto one replica, while the affinity rule spreads them and still keeps prompts sharing the chunk
        together."""
        bs = self.block_size
        return max(1, min(self.affinity_tokens // bs, (num_prompt_tokens - 1) // bs))

    def _by_affinity(
        self, prompt_token_ids: Sequence[int], healthy: list[int], least: int, lora_id: int | None
    ) -> tuple[int, str]:
        """Adapter affinity, then prefix affinity (rendezvous hashing), within the bound; else the least loaded."""
        if lora_id is not None:
            holders = [i for i in healthy if lora_id in self.replicas[i].adapters]
            if holders:
                best = min(holders, key=lambda i: self.replicas[i].outstanding_tokens)
                if self._within_bound(best, least):
                    return best, "affinity"
        key = self.prefix_key(prompt_token_ids) if lora_id is None else b"lora" + lora_id.to_bytes(8, "little")
        if key is None:
            return least, "least_loaded"
        pref = self.preferred(key, healthy)
        return (pref, "affinity") if self._within_bound(pref, least) else (least, "least_loaded")

    def _within_bound(self, idx: int, least: int) -> bool:
        load = self.replicas
        return load[idx].outstanding_tokens - load[least].outstanding_tokens <= self.max_imbalance_tokens

    def _least_loaded(self, healthy: list[int]) -> int:
        lowest = min(self.replicas[i].outstanding_tokens for i in healthy)
        ties = [i for i in healthy if self.replicas[i].outstanding_tokens == lowest]
        self._next += 1
        return ties[self._next % len(ties)]
