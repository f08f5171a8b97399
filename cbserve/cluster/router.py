"""Data-parallel routing: pick the engine replica for a request by load with prefix affinity.

Load is the number of outstanding tokens (prompt + tokens still to generate) of the requests this router
sent to a replica and that have not finished. Prefix affinity: the first block-aligned chunk of the prompt
(up to ``affinity_tokens`` tokens) is hashed and mapped to a preferred replica by rendezvous hashing over the
healthy replicas, so requests sharing a prefix land where that prefix is cached. The preferred replica is
used unless it has more than ``max_imbalance_tokens`` more outstanding tokens than the least loaded one.

LoRA adapter affinity: each replica remembers the last ``adapter_memory`` adapters it was sent (what its
workers keep loaded, ``max_cpu_loras``). A request for an adapter goes to the least loaded replica that has it,
within the same imbalance bound; otherwise to the adapter's own replica by rendezvous hashing of its id (not of
the prompt), so an adapter's requests gather on one replica instead of loading it everywhere. Pure Python (no
ray): the ingress owns one Router and tells it which replicas are healthy.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


class NoHealthyReplicaError(RuntimeError):
    """Every engine replica is down or still starting (HTTP 503)."""


@dataclass
class ReplicaState:
    outstanding_tokens: int = 0
    num_requests: int = 0  # in flight
    total_routed: int = 0
    healthy: bool = False
    adapters: OrderedDict[int, None] = field(default_factory=OrderedDict)  # recently sent adapter ids, oldest first


class Router:
    def __init__(
        self, num_replicas: int, block_size: int, affinity_tokens: int = 64, max_imbalance_tokens: int = 4096,
        adapter_memory: int = 1,
    ) -> None:
        if num_replicas < 1 or block_size < 1 or adapter_memory < 1:
            raise ValueError("num_replicas, block_size and adapter_memory must be positive")
        self.block_size = block_size
        self.affinity_tokens = affinity_tokens
        self.max_imbalance_tokens = max_imbalance_tokens
        self.adapter_memory = adapter_memory
        self.replicas = [ReplicaState() for _ in range(num_replicas)]
        self._next = 0  # round-robin tie break among equally loaded replicas

    # ---- health and load ------------------------------------------------------------------
    def set_healthy(self, idx: int, healthy: bool) -> None:
        self.replicas[idx].healthy = healthy

    def healthy_replicas(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.healthy]

    def add(self, idx: int, tokens: int, lora_id: int | None = None) -> None:
        """A request of ``tokens`` outstanding tokens (with adapter ``lora_id``, if any) went to replica ``idx``."""
        r = self.replicas[idx]
        r.outstanding_tokens += tokens
        r.num_requests += 1
        r.total_routed += 1
        if lora_id is not None:
            r.adapters[lora_id] = None
            r.adapters.move_to_end(lora_id)
            while len(r.adapters) > self.adapter_memory:
                r.adapters.popitem(last=False)

    def done(self, idx: int, tokens: int) -> None:
        r = self.replicas[idx]
        r.outstanding_tokens = max(0, r.outstanding_tokens - tokens)
        r.num_requests = max(0, r.num_requests - 1)

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
        self, prompt_token_ids: Sequence[int], exclude: Collection[int] = (), lora_id: int | None = None
    ) -> int:
        """The replica for a request (with adapter ``lora_id``, if any); ``exclude``: replicas that already
        turned it away (queue full)."""
        healthy = [i for i in self.healthy_replicas() if i not in exclude]
        if not healthy:
            raise NoHealthyReplicaError("no engine replica is ready" if not exclude else "every ready replica is full")
        least = self._least_loaded(healthy)
        if lora_id is not None:
            holders = [i for i in healthy if lora_id in self.replicas[i].adapters]
            if holders:
                best = min(holders, key=lambda i: self.replicas[i].outstanding_tokens)
                if self._within_bound(best, least):
                    return best
        key = self.prefix_key(prompt_token_ids) if lora_id is None else b"lora" + lora_id.to_bytes(8, "little")
        if key is None:
            return least
        pref = self.preferred(key, healthy)
        return pref if self._within_bound(pref, least) else least

    def _within_bound(self, idx: int, least: int) -> bool:
        load = self.replicas
        return load[idx].outstanding_tokens - load[least].outstanding_tokens <= self.max_imbalance_tokens

    def _least_loaded(self, healthy: list[int]) -> int:
        lowest = min(self.replicas[i].outstanding_tokens for i in healthy)
        ties = [i for i in healthy if self.replicas[i].outstanding_tokens == lowest]
        self._next += 1
        return ties[self._next % len(ties)]
