"""A consumer's pulls by transport (worker/kv/pulls.py, worker/kv/shared.py): a producer's published blocks reach
the consumer's pool from the producer's file when this node's folder has it, through the remote pull otherwise (or
always with ``transport: ray``; never with ``shm``), and a block that is not published is reported failed. The
remote pull here is a fake that reads the producer's real file in another folder (the served one, over the Ray
object store, is tests/e2e/test_kv_source.py's)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cbserve.scheduler.kv.connector import KVTransfer, KVTransferResult
from cbserve.worker.kv.shared import SharedSlots
from cbserve.worker.kv.tiers import HandOff, KVTiers

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block size, KV heads, head dim
BLOCKS = 6


def _tiers(role: str, folder: Path, transport: str = "auto", wait_s: float = 0.3) -> KVTiers:
    block = torch.Size(SHAPE).numel() * 4
    tiers = KVTiers(16 * block, None, 0, SHAPE, torch.float32,
                    handoff=HandOff(role, folder, "key", 30.0, wait_s, transport))  # fmt: skip
    g = torch.Generator().manual_seed(sum(map(ord, role)))  # each role's pool its own
    tiers.register_kv_caches([(torch.randn(BLOCKS, *SHAPE[2:], generator=g), torch.randn(BLOCKS, *SHAPE[2:],
                                                                                         generator=g))
                              for _ in range(SHAPE[0])])  # fmt: skip
    return tiers


class FileRemote:
    """A remote pull that reads the producer's file where it is (standing in for the Ray object store)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.calls = folder, []

    def __call__(self, producer: str, hashes: list[int], wait_s: float, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> tuple[list[int], torch.Tensor | None]:
        self.calls.append(producer)
        return SharedSlots.open(self.folder / f"{producer}.kvshm", block_shape, dtype).read(hashes, wait_s)


def _pull(consumer: KVTiers, producer: str, hashes: list[int]) -> KVTransferResult:
    consumer.start_load_kv(KVTransfer(pulls=[(h, producer) for h in hashes]))
    report = KVTransferResult()
    deadline = time.monotonic() + 10
    while len(report.pulled) + len(report.failed) < len(hashes) and time.monotonic() < deadline:
        consumer.wait_for_prefetch(0.05)
        got = consumer.get_finished()
        if got is not None:
            report.pulled += got.pulled
            report.failed += got.failed
            report.bytes_pulled += got.bytes_pulled
            report.bytes_pulled_ray += got.bytes_pulled_ray
    return report


def _block(tiers: KVTiers, b: int) -> torch.Tensor:
    return torch.stack([torch.stack([kv[0][b], kv[1][b]]) for kv in tiers.kv_caches])


@pytest.fixture()
def producer(tmp_path: Path) -> Any:
    p = _tiers("kv_producer", tmp_path / "node-a")
    p.start_load_kv(KVTransfer(stores=[(b, 100 + b) for b in range(4)]))  # blocks 0-3 published, as 100-103
    yield p
    p.shutdown()


@pytest.mark.parametrize("transport, folder, remote", [("auto", "node-a", False), ("auto", "node-b", True),
                                                       ("ray", "node-a", True)])  # fmt: skip
def test_published_blocks_land_in_the_pool_from_the_file_or_the_remote_pull(
    producer: KVTiers, tmp_path: Path, transport: str, folder: str, remote: bool
) -> None:
    consumer = _tiers("kv_consumer", tmp_path / folder, transport)
    consumer.remote = fake = FileRemote(tmp_path / "node-a")
    name = producer.config.shm_name
    report = _pull(consumer, name, [100, 102, 103, 999])  # 999: never published
    assert sorted(report.pulled) == [100, 102, 103] and report.failed == [999]
    assert fake.calls == ([name] if remote else [])
    assert report.bytes_pulled == 3 * consumer.block_bytes and report.bytes_pulled_ray == (report.bytes_pulled
                                                                                           if remote else 0)
    consumer.start_load_kv(KVTransfer(loads=[(5, 102), (4, 100)]))
    assert torch.equal(_block(consumer, 5), _block(producer, 2)) and torch.equal(_block(consumer, 4),
                                                                                 _block(producer, 0))
    consumer.shutdown()


def test_shm_alone_never_pulls_remotely_and_no_remote_pull_fails_the_blocks(producer: KVTiers, tmp_path: Path) -> None:
    shm = _tiers("kv_consumer", tmp_path / "node-b", "shm")
    shm.remote = fake = FileRemote(tmp_path / "node-a")
    assert _pull(shm, producer.config.shm_name, [100, 101]).failed == [100, 101] and fake.calls == []
    offline = _tiers("kv_consumer", tmp_path / "node-b")  # an engine without a remote transport (the offline LLM)
    assert _pull(offline, producer.config.shm_name, [100]).failed == [100]
    for tiers in (shm, offline):
        tiers.shutdown()


def test_a_remote_pull_that_raises_fails_its_blocks_and_the_next_pull_still_runs(
    producer: KVTiers, tmp_path: Path
) -> None:
    consumer = _tiers("kv_consumer", tmp_path / "node-b")
    good = FileRemote(tmp_path / "node-a")

    def flaky(*args: Any) -> tuple[list[int], torch.Tensor | None]:
        if not good.calls:
            good.calls.append("raised")
            raise ConnectionError("the source went away")
        return good(*args)

    consumer.remote = flaky
    assert _pull(consumer, producer.config.shm_name, [100]).failed == [100]
    assert _pull(consumer, producer.config.shm_name, [101]).pulled == [101]
    consumer.shutdown()


def test_read_copies_published_blocks_and_waits_for_one_published_meanwhile(producer: KVTiers) -> None:
    slots = SharedSlots.open(producer.shared.path, SHAPE, torch.float32)
    found, blocks = slots.read([103, 7, 100], 0.0)
    assert found == [103, 100] and torch.equal(blocks[0], _block(producer, 3)) and blocks.shape == (2, *SHAPE)
    late = [(4, 104)]  # published 0.1 s after the read starts, within its 2 s wait
    t0 = time.monotonic()
    timer = threading.Timer(0.1, producer.start_load_kv, [KVTransfer(stores=late)])
    timer.start()
    found, blocks = slots.read([104], 2.0)
    timer.join()
    assert found == [104] and torch.equal(blocks[0], _block(producer, 4)) and time.monotonic() - t0 < 1.5


def test_the_offline_llm_refuses_the_ray_transport_and_a_bad_one_is_named() -> None:
    from cbserve import LLM

    with pytest.raises(ValueError, match="transport 'ray'"):
        LLM(None, device="cpu", kv_offloading_size=0.01, disaggregation={"kv_role": "kv_consumer", "transport": "ray"})
    with pytest.raises(ValueError, match="transport"):
        LLM(None, device="cpu", kv_offloading_size=0.01, disaggregation={"kv_role": "kv_consumer", "transport": "nixl"})


@pytest.mark.parametrize("dst_rows, src_rows", [([0, 1, 2, 7, 8], [5, 6, 7, 0, 1]),  # 2 runs: slices
                                                ([3, 0, 7, 1, 5, 2, 6, 4, 9, 8], list(range(10)))])  # fmt: skip
def test_copy_rows_moves_each_row_and_nothing_else(dst_rows: list[int], src_rows: list[int]) -> None:
    from cbserve.worker.kv.shared import copy_rows

    src, dst = torch.randn(10, 3), torch.zeros(12, 3)
    copy_rows(dst, dst_rows, src, src_rows)
    assert all(torch.equal(dst[d], src[s]) for d, s in zip(dst_rows, src_rows, strict=True))
    assert not dst[[i for i in range(12) if i not in dst_rows]].any()


def test_a_block_whose_slot_went_meanwhile_is_neither_written_nor_counted(producer: KVTiers, tmp_path: Path) -> None:
    from cbserve.worker.kv.pulls import pull

    consumer = _tiers("kv_consumer", tmp_path / "node-a")
    slot = consumer._slot(101)  # 101's slot is ours; 100's (slot 7) was released before the copy
    before = consumer.slots[7].clone()
    done, remote = pull(consumer, producer.config.shm_name, [(100, 7), (101, slot)], time.monotonic())
    assert (done, remote) == ([101], False) and torch.equal(consumer.slots[7], before)
    assert torch.equal(consumer.slots[slot], _block(producer, 1))
    consumer.shutdown()


def test_copy_rows_of_no_rows_copies_nothing() -> None:
    from cbserve.worker.kv.shared import copy_rows

    dst = torch.zeros(3, 2)
    copy_rows(dst, [], torch.ones(3, 2), [])
    assert not dst.any()
