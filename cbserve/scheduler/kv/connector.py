"""The KV connector interface: how KV blocks reach the engine from outside its pool and leave it, in the shape of
vLLM's ``KVConnectorBase_V1``. One interface for the offload tiers (offload.py: a RAM tier and a disk tier below
the pool) and, next, for prefill/decode disaggregation.

Each connector has two halves that talk only through the step's messages (scheduler/outputs.py): the scheduler's
half decides, per step, what moves (``KVTransfer`` in the ``SchedulerOutput``), and the worker's half carries it
out before the forward pass and reports what happened (``KVTransferResult`` in the ``ModelRunnerOutput``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cbserve.scheduler.requests.kv_transfer import KVTransferParams


@dataclass(slots=True)
class KVTransfer:
    """What a step asks of the KV tiers below the pool (scheduler/kv/offload.py), carried out by the worker before the
    forward pass, in this order: ``evict`` (RAM tier entries dropped: never one this step loads), ``stores`` (pool
    block -> the RAM tier, then the disk tier in the background), ``loads`` (the RAM tier -> a pool block the step's
    requests then read); ``disk_evict`` (disk files deleted) in the background. ``prefetch``: disk -> RAM tier in
    the background, reported done in a later step's ``KVTransferResult``; ``pulls`` the same from a producer's
    shared-memory tier (prefill/decode disaggregation); ``poll``: a step sent only to collect those reports."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (block id, block hash)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (block id, block hash)
    evict: list[int] = field(default_factory=list)
    prefetch: list[int] = field(default_factory=list)
    disk_evict: list[int] = field(default_factory=list)
    poll: bool = False
    pulls: list[tuple[int, str]] = field(default_factory=list)  # (block hash, producer): its shared tier -> RAM tier

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.evict or self.prefetch or self.disk_evict or self.poll
                    or self.pulls)


@dataclass(slots=True)
class KVTransferResult:
    """What the worker's tiers did since its last report: blocks written to disk, prefetches done (now in the RAM
    tier) or failed (a missing, truncated or corrupt file: never served, the tokens are computed), and what the
    moves cost."""

    on_disk: list[int] = field(default_factory=list)
    off_disk: list[int] = field(default_factory=list)  # files another replica sharing the folder deleted
    prefetched: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    bytes_from_disk: int = 0
    store_s: float = 0.0
    load_s: float = 0.0
    pulled: list[int] = field(default_factory=list)  # of ``prefetched``, those pulled from a producer
    bytes_pulled: int = 0
    bytes_pulled_ray: int = 0  # of those bytes, the ones a producer on another node sent through the Ray object store
    pull_s: float = 0.0  # from a pull's start (the step that asked it) to its blocks in the RAM tier


class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(self, token_ids: Sequence[int], extra_keys: tuple, parent: int | None,
                                   num_cached_blocks: int, remote: KVTransferParams | None = None
                                   ) -> tuple[list[int], bool]:
        """The hashes of the blocks after the pool's ``num_cached_blocks`` hits (``parent``: the last hit's hash)
        that the connector can load into the pool in this step, and whether more would be ready later (the
        request then waits: its blocks are on their way, e.g. from disk or, ``remote``, from the producer that
        prefilled it: its ``KVTransferParams``)."""
        ...

    def update_state_after_alloc(self, blocks: list[tuple[int, int]]) -> None:
        """The pool blocks (id, hash) allocated for the tokens ``get_num_new_matched_tokens`` offered: load them."""
        ...

    def build_connector_meta(self, completed: list[tuple[int, int]]) -> KVTransfer | None:
        """This step's moves; ``completed``: the blocks (id, hash) the pool registered since the last step (their
        KV is computed), which the connector may store."""
        ...

    def update_connector_output(self, result: KVTransferResult) -> None:
        """What the worker's half reports after a step."""
        ...

    def steps_dropped(self, transfers: list[KVTransfer]) -> None:
        """Steps that failed or were skipped at the worker (scheduler/fault_isolation.py): what they asked may not
        have happened."""
        ...

    def request_finished(self, seq_id: str, block_ids: list[int]) -> bool:
        """A sequence finished: True keeps its blocks until the connector is done with them (disaggregation)."""
        ...


class WorkerConnector(Protocol):
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The pool's tensors, one (K, V) per layer."""
        ...

    def start_load_kv(self, transfer: KVTransfer) -> None:
        """Carry out the step's moves before its forward pass (stores first, then loads)."""
        ...

    def get_finished(self) -> KVTransferResult | None:
        """What finished since the last call (background writes and reads, failures)."""
        ...
