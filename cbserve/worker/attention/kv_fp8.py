"""The FP8 KV cache (``kv_cache_dtype="fp8"``): e4m3 keys and values with one float32 scale per token and KV head.

A layer's cache is an ``Fp8KVCache``: the (K, V) pair every backend unpacks, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``torch.float8_e4m3fn``, and its scales ``k_scale`` /
``v_scale`` ``[num_blocks, block_size, num_kv_heads]`` float32. Writing a token quantizes each of its head vectors
on its own (``fp8.quantize_rows``: the vector's largest magnitude maps to 448); the Triton kernels dequantize
inside the attention loop (a key's scale multiplies its logits, a value's scale its softmax weights), the torch
backend here, block by block, into the model's dtype.

Why a scale per token and head rather than vLLM's per-tensor default (scale 1.0 unless a calibrated checkpoint
brings others): a bf16 checkpoint carries no KV scales and the cache's blocks are shared by every request, so a
per-tensor or per-head scale would be fixed at start-up, uncalibrated: keys beyond 448 (Qwen-style outliers)
saturate and small values (|x| < 2^-6, common in V) lose their precision as subnormals. A scale per head vector
fits every vector to e4m3's range as it is written, whatever the model, for 4 bytes per ``head_dim`` bytes
(3% at 128) and one multiply per key tile.
"""

from __future__ import annotations

import torch

from cbserve.worker.fp8 import FP8_DTYPE, quantize_rows


class Fp8KVCache(tuple[torch.Tensor, torch.Tensor]):
    """One layer's FP8 cache: unpacks as (K, V) like a plain cache; ``k_scale`` / ``v_scale`` hold the scales."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> Fp8KVCache:
        if k.dtype != FP8_DTYPE or v.dtype != FP8_DTYPE:
            raise ValueError(f"an FP8 KV cache holds {FP8_DTYPE}, got {k.dtype} / {v.dtype}")
        if k_scale.shape != k.shape[:-1] or v_scale.shape != v.shape[:-1] or k_scale.dtype != torch.float32:
            raise ValueError(
                f"FP8 KV scales must be float32 {tuple(k.shape[:-1])}, got {tuple(k_scale.shape)} {k_scale.dtype}"
            )
        self = super().__new__(cls, (k, v))
        self.k_scale, self.v_scale = k_scale, v_scale
        return self


def kv_scales(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) of an FP8 cache; None for a cache in the model's dtype."""
    return (kv_cache.k_scale, kv_cache.v_scale) if isinstance(kv_cache, Fp8KVCache) else None


def allocate_fp8_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> Fp8KVCache:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k, v = (torch.zeros(shape, dtype=FP8_DTYPE, device=device) for _ in range(2))
    k_scale, v_scale = (torch.ones(shape[:-1], dtype=torch.float32, device=device) for _ in range(2))
    return Fp8KVCache(k, v, k_scale, v_scale)


def write_fp8(k: torch.Tensor, v: torch.Tensor, kv_cache: Fp8KVCache, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's keys/values [tokens, kv_heads, head_dim] per head vector into their cache slots
    (torch has no index_copy for float8: the bytes are copied as uint8)."""
    for x, cache, scales in ((k, kv_cache[0], kv_cache.k_scale), (v, kv_cache[1], kv_cache.v_scale)):
        q, s = quantize_rows(x)
        heads, dim = cache.shape[-2:]
        cache.view(torch.uint8).view(-1, heads, dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
        scales.view(-1, heads).index_copy_(0, slot_mapping, s.squeeze(-1))


def gather_fp8(kv_cache: Fp8KVCache, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``blocks`` (1-D int64 block ids) dequantized to ``dtype``, [len(blocks), block_size, heads, dim]."""
    out = []
    for cache, scales in ((kv_cache[0], kv_cache.k_scale), (kv_cache[1], kv_cache.v_scale)):
        q = cache.view(torch.uint8).index_select(0, blocks).view(FP8_DTYPE)
        out.append((q.float() * scales.index_select(0, blocks).unsqueeze(-1)).to(dtype))
    return out[0], out[1]


def copy_fp8_blocks(kv_cache: Fp8KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks ``src`` to ``dst`` (int64 ids), values and scales."""
    for t in (kv_cache[0].view(torch.uint8), kv_cache[1].view(torch.uint8), kv_cache.k_scale, kv_cache.v_scale):
        t.index_copy_(0, dst, t.index_select(0, src))
