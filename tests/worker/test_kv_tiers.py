"""The KV tiers below the pool (scheduler/kv/offload.py, worker/kv/tiers.py) on the real runner: the offline
``LLM`` over a tiny random Llama whose pool holds fewer blocks than the conversations need, so that their second
turns find their first turns' blocks evicted from the pool. Every figure is checked against an engine without
tiers: the tokens are the same, token for token (the tiers keep the cache's dtype: lossless), while the tiers
served the prefixes: from the RAM tier, then, in a new engine over the same disk folder (a restart), from disk;
corrupt, truncated and missing files are detected by their checks, never served, and recomputed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_llama import make_tiny_llama

from cbserve import LLM, SamplingParams
from cbserve.scheduler.kv.offload import DISK_SUFFIX

ARGS: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=64, max_num_seqs=8, block_size=4,
                            kv_cache_memory_bytes=48 * 1024, max_num_batched_tokens=64, progress=False)  # fmt: skip
MIB = 1 / 1024  # GiB
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TURN1 = [[1] + [100 + 37 * c + i for i in range(36)] for c in range(8)]  # 8 conversations of 9 full blocks


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _turn2(replies: list[list[int]]) -> list[list[int]]:
    return [t + r + [7, 8, 9, 10, 11] for t, r in zip(TURN1, replies, strict=True)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiers") / "tiny")


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Both turns without tiers: the second turns' prefixes were evicted from the pool and are recomputed."""
    llm = LLM(str(model), **ARGS)
    assert llm.engine.scheduler.kv.num_blocks * 4 < len(TURN1) * 36  # the conversations do not fit the pool
    first = _generate(llm, TURN1)
    return first, _generate(llm, _turn2(first))


def test_the_ram_tier_serves_evicted_prefixes_with_the_same_tokens(model: Path, reference: Any) -> None:
    llm = LLM(str(model), kv_offloading_size=MIB, **ARGS)
    first = _generate(llm, TURN1)
    second = _generate(llm, _turn2(first))
    assert (first, second) == reference
    s = llm.engine.scheduler.offload.stats
    assert s.hit_tokens_ram >= 8 * 4 * 4 and s.hit_tokens_disk == 0  # most conversations' turn 1 came back
    assert s.blocks_stored >= 8 * 9 and s.bytes_loaded == s.blocks_loaded * 2048
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_a_restarted_engine_warms_from_the_disk_tier(model: Path, reference: Any, tmp_path: Path) -> None:
    tiers = dict(kv_offloading_size=MIB, kv_disk_path=str(tmp_path / "kv"), kv_disk_size=MIB)
    first_engine = LLM(str(model), **tiers, **ARGS)
    assert _generate(first_engine, TURN1) == reference[0]
    first_engine.shutdown()  # waits for the disk writes
    files = list((tmp_path / "kv").glob(f"*/*{DISK_SUFFIX}"))
    assert len(files) >= 8 * 9
    restarted = LLM(str(model), **tiers, **ARGS)
    assert _generate(restarted, _turn2(reference[0])) == reference[1]
    s = restarted.engine.scheduler.offload.stats
    assert s.hit_tokens_disk >= 8 * 9 * 4 and s.prefetch_failures == 0 and s.bytes_from_disk > 0


def test_corrupt_truncated_and_missing_files_are_recomputed_never_served(
    model: Path, reference: Any, tmp_path: Path
) -> None:
    tiers = dict(kv_offloading_size=MIB, kv_disk_path=str(tmp_path / "kv"), kv_disk_size=MIB)
    writer = LLM(str(model), **tiers, **ARGS)
    _generate(writer, TURN1)
    writer.shutdown()
    files = sorted((tmp_path / "kv").glob(f"*/*{DISK_SUFFIX}"))
    corrupt, truncated, missing = files[0], files[1], files[2]
    good = corrupt.read_bytes()
    data = bytearray(good)
    data[-5] ^= 0xFF  # one flipped byte in the payload: the digest catches it
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    restarted = LLM(str(model), **tiers, **ARGS)
    missing.unlink()  # gone after the engine listed the folder
    assert _generate(restarted, _turn2(reference[0])) == reference[1]
    s = restarted.engine.scheduler.offload.stats
    assert s.prefetch_failures >= 3 and s.hit_tokens_disk > 0
    restarted.shutdown()  # the bad files were deleted, and the recomputed blocks written again
    assert corrupt.read_bytes() == good and len(truncated.read_bytes()) == len(good)


@pytest.mark.parametrize(("fields", "error"), [
    (dict(kv_disk_path="/tmp/x", kv_disk_size=1.0), "set kv_offloading_size too"),
    (dict(kv_offloading_size=1.0, kv_disk_path="/tmp/x"), "kv_disk_path needs kv_disk_size"),
    (dict(kv_offloading_size=1.0, kv_disk_size=1.0), "kv_disk_size needs kv_disk_path"),
    (dict(kv_offloading_size=1.0, enable_prefix_caching=False), "enable_prefix_caching off"),
    (dict(kv_offloading_size=1.0, kv_cache_dtype="fp8"), "kv_cache_dtype fp8"),
    (dict(kv_offloading_size=1.0, tensor_parallel_size=2), "tensor_parallel_size > 1"),
])  # fmt: skip
def test_what_the_tiers_cannot_do_is_refused(fields: dict[str, Any], error: str) -> None:
    from cbserve.config import CBServeConfig

    with pytest.raises(ValueError, match=error):
        CBServeConfig(device="cpu", **fields)


def test_a_bfloat16_tier_holds_twice_the_blocks_and_restores_them_rounded(model: Path, reference: Any) -> None:
    """``kv_offloading_dtype: bfloat16`` for a float32 cache: twice the blocks in the same GiB, each restored as its
    bfloat16 rounding (lossy: the tokens are compared with the lossless run's, not asserted equal)."""
    import torch

    lossless = LLM(str(model), kv_offloading_size=MIB, **ARGS)
    compressed = LLM(str(model), kv_offloading_size=MIB, kv_offloading_dtype="bfloat16", **ARGS)
    tiers, half = lossless.executor.runner.kv_tiers, compressed.executor.runner.kv_tiers
    assert half.config.ram_blocks == 2 * tiers.config.ram_blocks and half.block_bytes * 2 == tiers.block_bytes
    first = _generate(compressed, TURN1)
    assert first == reference[0]  # nothing restored yet
    pool, k_cache = compressed.engine.scheduler.kv.pool, compressed.executor.runner.kv_caches[0][0]
    h = next(h for h in half.ram if h in pool.cached)  # a stored block the pool still holds: compare with it
    assert half.slots.dtype == torch.bfloat16
    assert torch.equal(half.slots[half.ram[h]][0, 0], k_cache[pool.cached[h].block_id].to(torch.bfloat16))
    second = _generate(compressed, _turn2(first))
    agree = sum(a == b for x, y in zip(second, reference[1], strict=True) for a, b in zip(x, y, strict=True))
    assert compressed.engine.scheduler.offload.stats.hit_tokens_ram > 0
    assert agree >= len(second) * 4 // 2  # most greedy tokens agree with recomputing in float32


def test_an_int8_tier_holds_three_times_the_blocks_and_restores_them_within_half_a_step(
    model: Path, reference: Any, tmp_path: Path
) -> None:
    """``kv_offloading_dtype: int8``: each token's head vector as int8 with a float32 scale (a quarter of float32's
    bytes plus the scales: 1.25 bytes a value at head_dim 16); restored within half a quantization step of the
    cache's values, from RAM and from disk after a restart (lossy: tokens compared, not asserted equal)."""
    import torch

    tiers = dict(kv_offloading_size=MIB, kv_offloading_dtype="int8", kv_disk_path=str(tmp_path / "kv"),
                 kv_disk_size=MIB)  # fmt: skip
    lossless = LLM(str(model), kv_offloading_size=MIB, **ARGS).executor.runner.kv_tiers
    compressed = LLM(str(model), **tiers, **ARGS)
    q = compressed.executor.runner.kv_tiers
    assert q.slots.dtype == torch.int8 and q.config.ram_blocks >= 3 * lossless.config.ram_blocks
    first = _generate(compressed, TURN1)
    assert first == reference[0]  # nothing restored yet
    pool, k_cache = compressed.engine.scheduler.kv.pool, compressed.executor.runner.kv_caches[0][0]
    h = next(h for h in q.ram if h in pool.cached)  # a stored block the pool still holds
    slot, exact = q.ram[h], k_cache[pool.cached[h].block_id]
    restored = q.slots[slot][0, 0].float() * q.scales[slot][0, 0].unsqueeze(-1)
    assert bool(((restored - exact).abs() <= q.scales[slot][0, 0].unsqueeze(-1) * 0.5 + 1e-6).all())
    compressed.shutdown()  # its files written
    restarted = LLM(str(model), **tiers, **ARGS)
    second = _generate(restarted, _turn2(first))
    s = restarted.engine.scheduler.offload.stats
    assert s.hit_tokens_disk > 0 and s.prefetch_failures == 0
    agree = sum(a == b for x, y in zip(second, reference[1], strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= len(second) * 4 // 2  # most greedy tokens agree with recomputing in float32
    restarted.shutdown()


def test_a_write_cut_by_a_killed_process_leaves_no_block_and_its_file_is_cleared(tmp_path: Path) -> None:
    """A process killed mid-write leaves only its temporary file (the block is renamed into place whole, or not at
    all): the next engine over the folder deletes it; a live process's is left to finish."""
    import os
    import subprocess

    from cbserve.worker.kv.disk import remove_orphans

    gone = subprocess.Popen(["true"])  # a pid that existed and is gone
    gone.wait()
    orphan = tmp_path / f".0123456789abcdef{DISK_SUFFIX}.{gone.pid}.tmp"
    live = tmp_path / f".fedcba9876543210{DISK_SUFFIX}.{os.getpid()}.tmp"
    block = tmp_path / f"00000000000000aa{DISK_SUFFIX}"
    for f in (orphan, live, block):
        f.write_bytes(b"partial")
    assert remove_orphans(tmp_path) == 1
    assert not orphan.exists() and live.exists() and block.exists()


def test_vllms_kv_transfer_config_sets_the_tiers_or_is_refused_with_the_reason() -> None:
    from cbserve.config import CBServeConfig

    extra = {"cpu_bytes_to_use": 2**29, "block_size": 16, "disk_path": "/tmp/kv", "disk_bytes_to_use": 2**30}
    json_flag = '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": %s}'
    import json

    cfg = CBServeConfig(device="cpu", kv_transfer_config=json_flag % json.dumps(extra))  # as the CLI flag gives it
    assert (cfg.kv_offloading_size, cfg.kv_disk_path, cfg.kv_disk_size) == (0.5, "/tmp/kv", 1.0)
    assert cfg.engine_config(64).cache.offload is None  # the worker sizes the tiers in blocks (KVTiers.config)
    for bad, error in [
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "'NixlConnector' is not supported"),
        ({"kv_connector": "OffloadingConnector", "kv_role": "kv_lender",
          "kv_connector_extra_config": {"cpu_bytes_to_use": 1}}, "kv_role 'kv_lender'"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"num_cpu_blocks": 8}}, "takes"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {}}, "needs cpu_bytes_to_use"),
        ({"kv_connector": "OffloadingConnector",
          "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30, "block_size": 64}}, "engine's block_size"),
        ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30,
          "spec_name": "TieringOffloadingSpec"}}, "spec_name"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=error):
            CBServeConfig(device="cpu", kv_transfer_config=bad)
    with pytest.raises(ValueError, match="both set the KV tiers"):
        CBServeConfig(device="cpu", kv_offloading_size=2.0,
                      kv_transfer_config={"kv_connector": "OffloadingConnector",
                                          "kv_connector_extra_config": {"cpu_bytes_to_use": 2**30}})  # fmt: skip
    with pytest.raises(ValueError, match="not valid JSON"):
        CBServeConfig(device="cpu", kv_transfer_config="{nope")
    producer = CBServeConfig(device="cpu", kv_transfer_config={  # a P/D side (tests/worker/test_disaggregation.py)
        "kv_connector": "OffloadingConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 2**28}})
    assert producer.disaggregation.kv_role == "kv_producer" and producer.worker_model_config().kv_role == "kv_producer"


def test_replicas_sharing_a_disk_folder_see_each_others_blocks_while_running(
    model: Path, reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from cbserve.worker.kv import tiers as kv_tiers

    monkeypatch.setattr(kv_tiers, "RESCAN_S", 0.0)  # every step lists the folder (5 s when served)
    tiers = dict(kv_offloading_size=MIB, kv_disk_path=str(tmp_path / "kv"), kv_disk_size=MIB)
    other = LLM(str(model), **tiers, **ARGS)  # started first: its start-up listing found nothing
    writer = LLM(str(model), **tiers, **ARGS)
    assert _generate(writer, TURN1) == reference[0]
    writer.shutdown()  # its files are written
    for _ in range(2):  # steps that list the folder, then take the listing in
        _generate(other, [[3, 4, 5]])
        time.sleep(0.05)
    assert _generate(other, _turn2(reference[0])) == reference[1]
    s = other.engine.scheduler.offload.stats
    assert s.hit_tokens_disk >= 8 * 9 * 4 and s.prefetch_failures == 0
    other.shutdown()


def test_a_rescan_reports_the_files_others_wrote_and_deleted(tmp_path: Path) -> None:
    """The worker's listing of a shared folder (``KVTiers._rescan``, run by its disk thread every ``RESCAN_S``):
    another replica's new files come as ``on_disk``, its deletions as ``off_disk``, and the scheduler's index follows
    without deleting anything itself."""
    import torch

    from cbserve.scheduler.config import OffloadConfig
    from cbserve.scheduler.kv.offload import OffloadConnector
    from cbserve.worker.kv.tiers import KVTiers

    folder, shape = tmp_path / "kv", (1, 2, 4, 1, 8)
    mine, theirs = (KVTiers(2**16, folder, 2**20, shape, torch.float32) for _ in range(2))
    for h in (5, 6):
        theirs._write(h, torch.ones(shape))
    mine._rescan()
    report = mine.get_finished()  # (the next listing is RESCAN_S away)
    assert report is not None and sorted(report.on_disk) == [5, 6] and report.off_disk == []
    index = OffloadConnector(OffloadConfig(ram_blocks=4, disk_dir=str(folder), disk_blocks=8), 4, lambda *a: 0)
    assert sorted(index.disk) == [5, 6]  # a new index lists the folder itself
    theirs._unlink(5)
    mine._rescan()
    gone = mine.get_finished()
    assert gone is not None and gone.off_disk == [5] and gone.on_disk == []
    index.update_connector_output(gone)
    assert list(index.disk) == [6] and index._next.disk_evict == []  # forgotten, not deleted again
    mine.shutdown()
    theirs.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_whole_block_moves_equal_the_per_layer_ones(dtype: str) -> None:
    """The CUDA path (whole blocks: gathered on the device, one copy per block into its pinned slot and back), run
    here on the CPU: the same slots and the same restored cache as the per-layer path's."""
    import torch

    from cbserve.scheduler.kv.connector import KVTransfer
    from cbserve.worker.kv.tiers import KVTiers

    shape, tier_dtype = (3, 2, 4, 2, 8), getattr(torch, dtype)
    torch.manual_seed(0)
    source = [tuple(torch.randn(10, 4, 2, 8) for _ in range(2)) for _ in range(3)]
    restored = []
    for whole in (False, True):
        tiers = KVTiers(2**16, None, 0, shape, tier_dtype)
        tiers.whole_blocks = whole
        caches = [tuple(t.clone() for t in kv) for kv in source]
        tiers.register_kv_caches(caches)
        tiers.start_load_kv(KVTransfer(stores=[(1, 11), (4, 14), (7, 17)]))
        tiers.start_load_kv(KVTransfer(loads=[(8, 11), (9, 14), (0, 17)]))
        restored.append(caches)
        tiers.shutdown()
    for a, b in zip(*restored, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    exact = dtype == "float32"
    for layer in range(3):
        for i in (0, 1):
            got, want = restored[1][layer][i][[8, 9, 0]], source[layer][i][[1, 4, 7]]
            assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=want.abs().max().item() / 127)


@pytest.mark.parametrize("slots", [[5, 6, 7, 8], [0, 1, 4, 5, 9, 10], [0, 2, 4, 6, 8, 10]])
def test_blocks_in_runs_of_slots_move_in_place_and_scattered_ones_through_a_gather(slots: list[int]) -> None:
    """The per-layer path on slots in 1 or 3 runs of consecutive slots (one copy: the gather lands in the slots, the
    scatter reads them in place) and in 6 runs (more than MAX_RUNS: a gather, then a copy): the same blocks back."""
    import torch

    from cbserve.scheduler.kv.connector import KVTransfer
    from cbserve.worker.kv.tiers import MAX_RUNS, KVTiers

    shape = (3, 2, 4, 2, 8)
    torch.manual_seed(0)
    source = [tuple(torch.randn(16, 4, 2, 8) for _ in range(2)) for _ in range(3)]
    tiers = KVTiers(2**16, None, 0, shape, torch.float32)
    caches = [tuple(t.clone() for t in kv) for kv in source]
    tiers.register_kv_caches(caches)
    stores = [(b, 200 + b) for b in range(len(slots))]
    for (_, h), slot in zip(stores, slots, strict=True):  # the blocks' slots, as the tier's free list gave them
        tiers.free.remove(slot)
        tiers.ram[h] = slot
    runs = tiers._runs(slots)
    assert (len(runs) if runs is not None else None) == {4: 1, 6: 3 if slots[1] == 1 else None}[len(slots)]
    assert runs is not None or sum(1 for j in range(len(slots)) if j == 0 or slots[j] != slots[j - 1] + 1) > MAX_RUNS
    tiers.start_load_kv(KVTransfer(stores=stores))
    for (b, _), slot in zip(stores, slots, strict=True):  # the slots hold the blocks
        assert all(torch.equal(tiers.slots[slot, layer, i], source[layer][i][b]) for layer in range(3) for i in (0, 1))
    tiers.start_load_kv(KVTransfer(loads=[(15 - b, h) for b, h in stores]))
    for layer in range(3):
        for i in (0, 1):
            for b, _ in stores:
                assert torch.equal(caches[layer][i][15 - b], source[layer][i][b]), (layer, i, b)
    tiers.shutdown()
