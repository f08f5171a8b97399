"""Prefill/decode disaggregation across nodes, on a real local Ray (cluster/engine/kv_source.py): a producer's
published blocks reach a consumer whose node folder does not hold the producer's file through the producer's
``KVSource`` actor and the Ray object store, equal to what the producer stored; a block not published, a consumer of
another layout and a source that is gone fail their blocks (the scheduler computes them) and raise nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_lib import SharedRay

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

SHAPE = (3, 2, 16, 2, 64)  # layers, K/V, block size, KV heads, head dim
BLOCKS = 40


def _tiers(role: str, folder: Path, dtype: torch.dtype = torch.float32, transport: str = "auto") -> Any:
    from cbserve.worker.kv.tiers import HandOff, KVTiers

    block = torch.Size(SHAPE).numel() * torch.empty((), dtype=dtype).element_size()
    tiers = KVTiers((BLOCKS + 8) * block, None, 0, SHAPE, dtype,
                    handoff=HandOff(role, folder, "key", 30.0, 0.5, transport))  # fmt: skip
    g = torch.Generator().manual_seed(sum(map(ord, role)))  # each role's pool its own
    tiers.register_kv_caches([tuple(torch.randn(BLOCKS, *SHAPE[2:], generator=g).to(dtype) for _ in range(2))
                              for _ in range(SHAPE[0])])  # fmt: skip
    return tiers


def _pull(consumer: Any, producer: str, hashes: list[int]) -> tuple[list[int], list[int]]:
    from cbserve.scheduler.kv.connector import KVTransfer

    consumer.start_load_kv(KVTransfer(pulls=[(h, producer) for h in hashes]))
    pulled: list[int] = []
    failed: list[int] = []
    deadline = time.monotonic() + 60
    while len(pulled) + len(failed) < len(hashes) and time.monotonic() < deadline:
        consumer.wait_for_prefetch(0.05)
        got = consumer.get_finished()
        if got is not None:
            pulled, failed = pulled + got.pulled, failed + got.failed
    return sorted(pulled), sorted(failed)


@pytest.fixture()
def producer(shared_ray: SharedRay, tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A producer with every block published, and its source, started (each test its own)."""
    from cbserve.cluster.engine.kv_source import attach_ray_transport
    from cbserve.scheduler.kv.connector import KVTransfer

    shared_ray.start()
    tiers = _tiers("kv_producer", tmp_path / "node-a")
    tiers.start_load_kv(KVTransfer(stores=[(b, 1000 + b) for b in range(BLOCKS)]))
    source = attach_ray_transport(tiers)
    ray.get(source.__ray_ready__.remote(), timeout=120)
    yield tiers, source
    ray.kill(source)
    tiers.shutdown()


def test_a_consumer_on_another_node_gets_the_published_blocks_through_the_object_store(
    producer: tuple[Any, Any], tmp_path: Path
) -> None:
    from cbserve.cluster.engine.kv_source import RayPull, attach_ray_transport
    from cbserve.scheduler.kv.connector import KVTransfer

    tiers, _ = producer
    consumer = _tiers("kv_consumer", tmp_path / "node-b")
    assert attach_ray_transport(consumer) is None and isinstance(consumer.remote, RayPull)
    hashes = [1000 + b for b in range(0, BLOCKS, 2)]
    assert _pull(consumer, tiers.config.shm_name, [*hashes, 5]) == (hashes, [5])  # 5: never published
    consumer.start_load_kv(KVTransfer(loads=[(i, h) for i, h in enumerate(hashes)]))
    for i, h in enumerate(hashes):
        for layer in range(SHAPE[0]):
            for kv in (0, 1):
                assert torch.equal(consumer.kv_caches[layer][kv][i], tiers.kv_caches[layer][kv][h - 1000])
    other = _tiers("kv_consumer", tmp_path / "node-c", torch.bfloat16)  # another layout: refused by the source
    attach_ray_transport(other)
    assert _pull(other, tiers.config.shm_name, hashes[:2]) == ([], hashes[:2])
    shm = _tiers("kv_both", tmp_path / "node-d", transport="shm")  # shared memory alone: no source, no remote pull
    assert attach_ray_transport(shm) is None and shm.remote is None
    for t in (consumer, other, shm):
        t.shutdown()


def _wait_dead(actor: Any, timeout_s: float = 30.0) -> None:
    """Until a call to ``actor`` fails as a dead actor's does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.blocks.remote([], 0.0, SHAPE, "float32"), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"{actor} still answers {timeout_s} s after ray.kill")


def test_a_source_that_is_gone_fails_the_pull_and_raises_nothing(producer: tuple[Any, Any], tmp_path: Path) -> None:
    from cbserve.cluster.engine.kv_source import attach_ray_transport

    tiers, source = producer
    consumer = _tiers("kv_consumer", tmp_path / "node-b")
    attach_ray_transport(consumer)
    assert _pull(consumer, tiers.config.shm_name, [1001]) == ([1001], [])
    ray.kill(source)
    _wait_dead(source)  # ray.kill returns before the actor's process is gone: a call may still be answered
    assert _pull(consumer, tiers.config.shm_name, [1003]) == ([], [1003])
    consumer.shutdown()
