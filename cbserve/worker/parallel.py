"""Tensor-parallel helpers: world size / rank from torch.distributed when initialised, else a single rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from cbserve.scheduler.errors import StepFailedError


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group in place (no-op on one rank)."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (no-op on one rank)."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_token_ids(
    ids: list[list[int]] | None, num_lists: int, max_total: int, device: torch.device, failed: bool = False
) -> list[list[int]]:
    """Rank 0's ``ids`` (``num_lists`` lists of at most ``max_total`` ids in all, sizes every rank knows from
    its batch) on every rank, in one int64 broadcast on ``device`` (the process group's: CUDA for NCCL, the CPU
    for gloo): the lists' lengths, then their ids, then padding. No pickle; one host read on the other ranks.
    ``ids`` is only read on rank 0 (returned as is on a single rank). ``failed`` (rank 0): its sampling failed;
    the other ranks raise ``StepFailedError`` instead of waiting for ids (every rank fails the step)."""
    if tp_world_size() == 1:
        return ids if ids is not None else [[] for _ in range(num_lists)]
    if num_lists + max_total == 0:
        return []
    if tp_rank() != 0:
        buf = torch.empty(num_lists + max_total, dtype=torch.long, device=device)
        dist.broadcast(buf, src=0)
        values = buf.tolist()
        if values and values[0] < 0:
            raise StepFailedError("tensor-parallel rank 0 failed to sample this step")
        out, at = [], num_lists
        for n in values[:num_lists]:
            out.append(values[at : at + n])
            at += n
        return out
    if failed:
        ids, flat = [], [-1]
    elif ids is None or len(ids) != num_lists or sum(map(len, ids)) > max_total:
        raise ValueError(f"rank 0 must give {num_lists} lists of at most {max_total} ids in all")
    else:
        flat = [len(x) for x in ids] + [t for x in ids for t in x]
    host = torch.zeros(num_lists + max_total, dtype=torch.long, pin_memory=device.type == "cuda")
    host[: len(flat)] = torch.tensor(flat, dtype=torch.long)
    dist.broadcast(host.to(device, non_blocking=True), src=0)
    return ids


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator
