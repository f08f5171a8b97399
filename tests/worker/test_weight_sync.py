"""The RL weight sync's collective transport (cbserve/rl/weight_sync.py) between real processes: a trainer
(rank 0) and two engine ranks, started from a forkserver (fresh processes, torch imported once), on gloo over
loopback. The receivers hash what they got and report it through a queue; the parent compares with the hashes of
the tensors it generated the same way."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from cbserve.rl.weight_sync import (
    WeightGroup,
    WeightTransferInfo,
    _parse_dtype,
    free_port,
    plan_buckets,
)

BUCKET = 1536
HOST = "127.0.0.1"


def _tensors() -> dict[str, torch.Tensor]:
    """~20 tensors of mixed dtypes and shapes, the same in every process; two are larger than BUCKET."""
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    out = {}
    for i in range(18):
        shape = [(7,), (3, 5), (16, 16), (2, 3, 4), (100,), ()][i % 6]
        out[f"model.layers.{i}.weight"] = torch.randn(shape, generator=g).to(dtypes[i % 3])
    out["model.embed_tokens.weight"] = torch.randn(64, 96, generator=g).to(torch.bfloat16)  # 12 KiB > BUCKET
    out["model.norm.bias"] = torch.randn(0, 4, generator=g)  # empty
    out["lm_head.weight"] = torch.randn(40, 16, generator=g).t()  # not contiguous
    return out


def _digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return str(t.dtype), tuple(t.shape), hashlib.sha256(raw).hexdigest()


def _send(group: WeightGroup) -> dict:
    return {"bytes": group.send(_tensors().items(), bucket_bytes=BUCKET)}


def _receive(group: WeightGroup) -> dict:
    """Rank 1 keeps fresh buckets, rank 2 reuses one buffer (each tensor hashed before the next bucket)."""
    return {name: _digest(t) for name, t in group.receive(reuse_buffer=group.rank == 2)}


def _join_tp_group(rank: int, tp_port: int) -> None:
    """Ranks 1 and 2 form their own default (tensor-parallel) group before the weight group."""
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{tp_port}", rank=rank - 1, world_size=2)


def _tp_all_reduce(rank: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _member(rank: int, world: int, port: int, tp_port: int | None, job: Callable, out: mp.Queue) -> None:
    """One rank: (optionally join a default group,) join the weight group, run ``job``, report."""
    torch.set_num_threads(1)
    try:
        if tp_port is not None and rank > 0:
            _join_tp_group(rank, tp_port)
        with WeightGroup.open(HOST, port, rank, world, timeout_s=30) as group:
            report = {"result": job(group), "default_group": dist.is_initialized()}
        if tp_port is not None and rank > 0:
            report["tp_sum"] = _tp_all_reduce(rank)
            report["default_group_world"] = dist.get_world_size()
            dist.destroy_process_group()
        out.put((rank, report))
    except BaseException as e:  # reported, so the parent fails with the cause rather than a timeout
        out.put((rank, {"error": repr(e)}))


def _run(world: int, sender: Callable, receiver: Callable, tp: bool = False, wait_s: float = 60) -> dict:
    ctx = mp.get_context("forkserver")  # fresh processes like spawn, forked from one that imported torch once
    ctx.set_forkserver_preload(["torch", "torch.distributed", "cbserve.rl.weight_sync"])
    out = ctx.Queue()
    port, tp_port = free_port(), (free_port() if tp else None)
    procs = [
        ctx.Process(target=_member, args=(r, world, port, tp_port, sender if r == 0 else receiver, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + wait_s
        while len(reports) < world:
            rank, report = out.get(timeout=max(0.1, deadline - time.monotonic()))
            reports[rank] = report
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(reports))} reported nothing in {wait_s} s: {reports}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    assert not errors, errors
    return reports


def _expected() -> dict:
    return {name: _digest(t) for name, t in _tensors().items()}


def test_plan_packs_small_tensors_and_gives_an_oversize_one_its_own_bucket() -> None:
    slots, sizes = plan_buckets(list(_tensors().items()), BUCKET)
    assert len(sizes) >= 4
    members = [[s for s in slots if s.bucket == b] for b in range(len(sizes))]
    assert sum(len(m) > 1 for m in members) >= 2  # small tensors share buckets
    for size, m in zip(sizes, members, strict=True):
        if size > BUCKET:  # an over-size tensor (the embedding, lm_head): alone, but for empty ones
            assert [s.nbytes for s in m if s.nbytes] == [size]
    big = next(s for s in slots if s.name == "model.embed_tokens.weight")
    assert sizes[big.bucket] == big.nbytes > BUCKET
    assert all(s.offset % 64 == 0 and s.offset + s.nbytes <= sizes[s.bucket] for s in slots)


def test_two_receivers_get_every_tensor_bit_identical() -> None:
    reports = _run(3, _send, _receive)
    expected = _expected()
    assert reports[0]["result"]["bytes"] > BUCKET * 3
    for rank in (1, 2):
        got = reports[rank]["result"]
        assert list(got) == list(expected)  # the order of the trainer's iterable
        assert got == expected
        assert reports[rank]["default_group"] is False  # the weight group made none


def test_receivers_already_in_a_default_group_keep_it() -> None:
    reports = _run(3, _send, _receive, tp=True)
    expected = _expected()
    for rank in (1, 2):
        assert reports[rank]["result"] == expected
        assert reports[rank]["tp_sum"] == 3.0  # 1 + 2: the tensor-parallel group still all-reduces
        assert reports[rank]["default_group_world"] == 2 and reports[rank]["default_group"] is True


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="backend"):
        WeightGroup.open(HOST, 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="rank"):
        WeightGroup.open(HOST, 1, 3, 3)
    with pytest.raises(ValueError, match="world_size"):
        WeightTransferInfo(HOST, 1, world_size=1)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([], 0)
    infos = WeightTransferInfo.for_replicas(HOST, 1234, [2, 2, 1])
    assert [(i.world_size, i.rank(0), i.rank(1)) for i in infos] == [(6, 1, 2), (6, 3, 4), (6, 5, 6)]
    assert _parse_dtype("bfloat16") is torch.bfloat16


def test_a_rank_that_never_joins_is_named_in_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] of 3 did not join"):
        WeightGroup.open(HOST, free_port(), 0, 3, timeout_s=1)
    assert time.monotonic() - start < 10


THROUGHPUT_BYTES = 512 << 20


def _send_big(group: WeightGroup) -> dict:
    n = THROUGHPUT_BYTES // 16 // 2
    tensors = [(f"w{i}", torch.full((n,), float(i), dtype=torch.bfloat16)) for i in range(16)]
    seconds = []
    for _ in range(2):  # receivers: fresh buckets, then one reused buffer
        start = time.perf_counter()
        sent = group.send(tensors, bucket_bytes=64 << 20)
        seconds.append(time.perf_counter() - start)
    return {"bytes": sent, "seconds": seconds}


def _receive_big(group: WeightGroup) -> dict:
    ok = True
    for reuse in (False, True):
        for i, (_, t) in enumerate(group.receive(reuse_buffer=reuse)):
            ok = ok and t[0].item() == float(i) and t[-1].item() == float(i)
    return {"ok": ok}


def test_throughput_of_512_mb_to_two_receivers() -> None:
    """Measured, not asserted: the payload once (what each receiver gets) over the sender's wall time."""
    reports = _run(3, _send_big, _receive_big, wait_s=120)
    sent = reports[0]["result"]["bytes"]
    assert sent == THROUGHPUT_BYTES and all(reports[r]["result"]["ok"] for r in (1, 2))
    for mode, seconds in zip(["fresh buckets", "reused buffer"], reports[0]["result"]["seconds"], strict=True):
        print(
            f"\nweight sync (gloo, loopback, 2 receivers, {mode}): {sent / 1e9:.2f} GB in {seconds:.2f} s = "
            f"{sent / seconds / 1e9:.2f} GB/s per receiver ({2 * sent / seconds / 1e9:.2f} GB/s delivered in all)"
        )
