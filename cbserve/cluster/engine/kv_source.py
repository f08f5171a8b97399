"""Prefill/decode disaggregation across nodes: a producer's published KV blocks through the Ray object store.

A producer engine (``kv_producer``) publishes its prompts' blocks in a shared-memory file of its node
(worker/kv/shared.py), which decode engines of the same node map. For those on other nodes, the producer starts a
``KVSource`` beside it: a small actor on the producer's node, named by the producer's engine id
(``remote_engine_id``), that reads the file there and returns the blocks asked for; Ray moves them to the consumer's
node. The consumer's ``RayPull`` (the tiers' ``remote``, worker/kv/pulls.py) finds the source by that name. The
source is owned by the engine actor that started it, so it goes when that engine goes (its blocks are then computed
by the consumer, as with a file that is gone).
"""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cbserve.cluster.ops.names import NAMESPACE
from cbserve.worker.kv.shared import SharedSlots

logger = logging.getLogger(__name__)

START_GRACE_S = 5.0  # a pull waits this much beyond its pull_wait_s for a source still starting or busy
CALLS = 4  # pulls a source serves side by side (one consumer waiting for a block does not hold up the others)
# the object store's arrays are read-only and only read here; torch warns about every one of them
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def source_name(engine_id: str) -> str:
    return f"kv-source:{engine_id}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@ray.remote(max_restarts=0, max_concurrency=CALLS)
class KVSource:
    """One producer's file, mapped on the producer's node."""

    def __init__(self, path: str, block_shape: tuple[int, ...], dtype_name: str) -> None:
        self.slots = SharedSlots.open(Path(path), block_shape, getattr(torch, dtype_name))
        # a call's blocks, in a buffer of its thread reused (its pages touched once, not per call; Ray copies a
        # call's result out before its thread takes the next call)
        self.buffers = threading.local()

    def blocks(self, hashes: list[int], wait_s: float, block_shape: tuple[int, ...],
               dtype_name: str) -> tuple[list[int], np.ndarray]:
        """The published blocks of ``hashes`` (waiting up to ``wait_s``) as raw bytes; ValueError for a consumer of
        another layout."""
        shape, dtype = tuple(self.slots.slots.shape[1:]), _dtype_name(self.slots.slots.dtype)
        if tuple(block_shape) != shape or dtype_name != dtype:
            raise ValueError(f"this producer's blocks are {shape} {dtype}, not {tuple(block_shape)} {dtype_name}")
        buffer = getattr(self.buffers, "blocks", None)
        if buffer is None or buffer.shape[0] < len(hashes):
            buffer = self.buffers.blocks = torch.zeros((len(hashes), *shape), dtype=self.slots.slots.dtype)
        found, blocks = self.slots.read(hashes, wait_s, buffer)
        return found, blocks.view(torch.uint8).numpy().reshape(-1)  # (Ray copies it out as it returns)


def start_kv_source(tiers: Any) -> Any:
    """A producer's ``KVSource`` (its tiers' file, on this node), or None for an engine that publishes nothing."""
    shared = None if tiers is None else tiers.shared
    if shared is None:
        return None
    name = tiers.config.shm_name
    here = ray.get_runtime_context().get_node_id()
    return KVSource.options(name=source_name(name), namespace=NAMESPACE, num_cpus=0,  # type: ignore[attr-defined]
                            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote(
        str(shared.path), tuple(shared.slots.shape[1:]), _dtype_name(shared.slots.dtype))


class RayPull:
    """A consumer's pulls from producers' ``KVSource`` actors (worker/kv/pulls.py's ``RemotePull``)."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] = {}  # engine id -> its source's handle, looked up once

    def __call__(self, producer: str, hashes: list[int], wait_s: float, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[list[int], torch.Tensor | None]:
        try:
            source = self.sources.get(producer) or ray.get_actor(source_name(producer), namespace=NAMESPACE)
            self.sources[producer] = source
            found, raw = ray.get(source.blocks.remote(hashes, wait_s, block_shape, _dtype_name(dtype)),
                                 timeout=wait_s + START_GRACE_S)
        except (ValueError, RayError, GetTimeoutError) as e:  # no such source (the producer is gone), or it failed
            self.sources.pop(producer, None)
            logger.warning("KV pull from %s through the Ray object store failed (%s); its blocks are computed",
                           producer, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return [], None
        return found, torch.from_numpy(raw).view(dtype).view(len(found), *block_shape)


def attach_ray_transport(tiers: Any) -> Any:
    """Give an engine's tiers what disaggregation needs across nodes (none with ``transport: shm``): a consumer's
    ``RayPull``; a producer's ``KVSource`` (returned: its engine kills it when it goes)."""
    if tiers is None or tiers.handoff is None or tiers.handoff.transport == "shm":
        return None
    if tiers.producers is not None:
        tiers.remote = RayPull()
    return start_kv_source(tiers)
