"""Physical paged KV cache: one K and one V tensor [num_blocks, block_size, num_kv_heads, head_dim] per
layer, sizing from a memory budget, and block copies for copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cbserve.worker.attention.backend import KVCache


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes over all layers, K and V (this rank's heads only)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


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
) -> list[KVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def copy_blocks(kv_caches: list[KVCache], copies: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` to block ``dst`` in every layer's K and V (before the forward pass)."""
    if not copies:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
