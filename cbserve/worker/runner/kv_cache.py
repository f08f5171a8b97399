"""Physical paged KV cache: one K and one V tensor [num_blocks, block_size, num_kv_heads, head_dim] per
layer (with ``kv_fp8``, e4m3 values and their scales: attention/kv_fp8.py), sizing from a memory budget, and
block copies for copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbserve.worker.attention.backend import KVCache
from cbserve.worker.attention.kv_fp8 import Fp8KVCache, allocate_fp8_cache, copy_fp8_blocks
from cbserve.worker.config import kv_head_bytes


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_fp8: bool = False
) -> int:
    """Bytes one block takes over all layers, K and V (this rank's heads only; an FP8 cache's scales included)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * kv_head_bytes(head_dim, elem, kv_fp8)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    if budget_bytes < block_bytes:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes is below one block ({block_bytes} bytes); "
            "raise kv_cache_memory_bytes / gpu_memory_utilization"
        )
    return budget_bytes // block_bytes


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_fp8: bool = False,
) -> list[KVCache]:
    """Every layer's cache: in ``dtype``, or with ``kv_fp8`` an ``Fp8KVCache`` (e4m3 values, float32 scales)."""
    if kv_fp8:
        return [allocate_fp8_cache(num_blocks, block_size, num_kv_heads, head_dim, device) for _ in range(num_layers)]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def copy_blocks(kv_caches: list[KVCache], copies: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` to block ``dst`` in every layer's K and V (and an FP8 cache's scales), before the
    forward pass."""
    if not copies:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for kv in kv_caches:
        if isinstance(kv, Fp8KVCache):
            copy_fp8_blocks(kv, src, dst)
            continue
        k_cache, v_cache = kv
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
