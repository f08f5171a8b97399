"""A consumer's pulls of prefill/decode disaggregation (tiers.py runs them in its pull thread): a producer's published
blocks copied into this engine's RAM tier slots, by one of two transports.

- **Shared memory** (shared.py): the producer's tier file in this node's folder, mapped; each block copied straight
  from its slot, counted when its tag holds its hash before and after the copy.
- **Remote** (a producer on another node, or ``transport: ray``): ``RemotePull``, given by the served engine
  (cluster/engine/kv_source.py: the producer's ``KVSource`` actor reads its file on its node and the blocks come
  through the Ray object store). The offline ``LLM`` has none.

``transport`` "auto" takes the file when this node's folder has it and the remote pull otherwise; "shm" only the
file; "ray" only the remote pull. A block neither brings within ``pull_wait_s`` fails (the scheduler computes it).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from cbserve.worker.kv.shared import as_tag, copy_rows

logger = logging.getLogger(__name__)

LOCKED_BLOCKS = 16  # a pull copies this many blocks at most per hold of the tiers' lock (the step thread's)


class RemotePull(Protocol):
    def __call__(self, producer: str, hashes: list[int], wait_s: float, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[list[int], torch.Tensor | None]:
        """The producer's published blocks of ``hashes`` (waiting up to ``wait_s`` for those not yet published):
        the hashes found and their blocks (``[len(found), *block_shape]``); ``([], None)`` when it cannot reach the
        producer (it logs why)."""
        ...


def pull(tiers: Any, producer: str, items: list[tuple[int, int]], asked_at: float) -> tuple[list[int], bool]:
    """Copy ``producer``'s published blocks into their slots here (``items``: (hash, slot)): the hashes that landed,
    and whether they came through the remote pull. ``tiers``: the consumer's ``KVTiers``."""
    handoff = tiers.handoff
    deadline = asked_at + handoff.pull_wait_s
    remote = handoff.transport == "ray" or (handoff.transport == "auto" and not tiers.producers.local(producer))
    if not remote:
        return _from_file(tiers, producer, items, deadline), False
    if tiers.remote is None:
        logger.warning("KV pull from %s: its file is not in %s and this engine has no remote transport (served "
                       "engines have the Ray object store); its blocks are computed", producer, handoff.folder)
        return [], True
    if not tiers.producers.same_model(producer):
        return [], True
    found, blocks = tiers.remote(producer, [h for h, _ in items], max(0.0, deadline - time.monotonic()),
                                 tiers.block_shape, tiers.dtype)
    if blocks is None:
        return [], True
    return _fill_ours(tiers, dict(items), found, blocks, list(range(len(found)))), True


def _from_file(tiers: Any, producer: str, items: list[tuple[int, int]], deadline: float) -> list[int]:
    source = tiers.producers.get(producer)
    if source is None:
        return []
    slot_of, written = dict(items), set()

    def take(hashes: list[int], at: list[int]) -> None:
        written.update(_fill_ours(tiers, slot_of, hashes, source.slots, at))

    found = source.copy_published(list(slot_of), max(0.0, deadline - time.monotonic()), take)
    return [h for h in found if h in written]  # (a block whose slot went meanwhile is not pulled)


def _fill_ours(tiers: Any, slot_of: dict[int, int], hashes: list[int], src: torch.Tensor,
               src_rows: list[int]) -> list[int]:
    """``src[src_rows[i]]`` into the slot here of ``hashes[i]``, LOCKED_BLOCKS at a time under the tiers' lock, but
    where that slot was released meanwhile (another block's now); the hashes written."""
    written: list[int] = []
    for i in range(0, len(hashes), LOCKED_BLOCKS):
        with tiers._lock:
            mine = [(h, r) for h, r in zip(hashes[i:i + LOCKED_BLOCKS], src_rows[i:i + LOCKED_BLOCKS], strict=True)
                    if tiers.ram.get(h) == slot_of[h]]  # fmt: skip
            if mine:
                ours = [h for h, _ in mine]
                _fill(tiers, ours, [slot_of[h] for h in ours], src, [r for _, r in mine])
                written += ours
    return written


def _fill(tiers: Any, hashes: list[int], slots: list[int], src: torch.Tensor, src_rows: list[int]) -> None:
    """Pulled blocks into their ``slots`` (``src[src_rows[i]]`` into ``slots[i]``; the caller holds the tiers' lock),
    a shared tier's tags (a ``kv_both`` engine's) cleared while they are written."""
    if tiers.shared is not None:
        tiers.shared.tags[slots] = 0
    copy_rows(tiers.slots, slots, src, src_rows)
    if tiers.shared is not None:
        tiers.shared.tags[slots] = torch.tensor([as_tag(h) for h in hashes], dtype=torch.int64)
