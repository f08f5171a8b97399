"""Paged attention on Triton: the launchers the Triton and flash backends call (kernels: ``triton_jit.py``).

Three jobs, one kernel each (two for decode: split pass + merge):

- ``write_kv_cache``: scatter this step's K/V rows into the paged cache at ``slot_mapping``
  (``slot = block_id * block_size + offset``); rows with ``slot < 0`` (padding) are skipped.
- ``prefill_attention``: varlen causal attention over the flattened batch. Request ``r`` owns query rows
  ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``; its K/V (cached prefix *and* this step's new tokens, already
  written) live in the paged cache behind ``block_tables[r]``. The query at position ``p`` (``p`` counts from
  the start of the sequence, so prefix-cache hits and chunked prefill are the same case) attends to keys
  ``0..p``. ``seq_lens[r]`` is the request's total context after this step.
- ``decode_attention``: one query token per request, split-KV ("flash decoding"). The number of splits is
  a launch constant, so the launch is shape-stable (CUDA-graph friendly): each request's split length is
  computed in-kernel from its own ``seq_len``.

Cache layout, per layer: K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous
last dimension; ``block_tables`` is int32 ``[num_reqs, max_blocks]``. An FP8 cache (``kv_fp8.py``) is e4m3 with
its scales given as ``kv_scales`` (k_scale, v_scale), each float32 ``[num_blocks, block_size, num_kv_heads]``.
The kernels run natively on CUDA and, at small sizes, on CPU tensors under ``TRITON_INTERPRET=1`` (set before
``triton`` is imported). Kernels are looked up on the ``triton_jit`` module at each launch, so reloading it
(interpreter tests) takes effect.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import torch
import triton

from cbserve.worker.attention import triton_jit
from cbserve.worker.fp8 import FP8_DTYPE

_LOG2E = 1.4426950408889634


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"K/V caches must be [num_blocks, block_size, kv_heads, head_dim] and equal: "
            f"{tuple(k_cache.shape)} vs {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share strides and have a contiguous last dimension")


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [tokens, heads, head_dim] with a contiguous last dim, got "
            f"shape {tuple(x.shape)} strides {x.stride()}"
        )


def _check_query(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_cache(k_cache, v_cache)
    _check_rows("q", q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if num_q_heads % k_cache.shape[2] or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"q heads {num_q_heads}/head_dim {head_dim} incompatible with cache {tuple(k_cache.shape)}"
        )


def _scale_args(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, Any]:
    """The kernels' FP8 arguments: the scales and their strides, or placeholders never read (KV_FP8 off).
    ValueError when an e4m3 cache comes without scales or they do not match it."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (kv_scales is not None):
        raise ValueError(f"a {k_cache.dtype} cache takes {'its' if fp8 else 'no'} kv_scales")
    if kv_scales is None:
        return dict(k_scale_ptr=k_cache, v_scale_ptr=k_cache, stride_s_blk=0, stride_s_off=0, KV_FP8=False)
    k_scale, v_scale = kv_scales
    want = tuple(k_cache.shape[:3])
    for s in kv_scales:
        if tuple(s.shape) != want or s.dtype != torch.float32 or s.stride() != k_scale.stride() or s.stride(-1) != 1:
            raise ValueError(f"kv_scales must be float32 {want} with equal strides, got {tuple(s.shape)} {s.dtype}")
    return dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, stride_s_blk=k_scale.stride(0),
                stride_s_off=k_scale.stride(1), KV_FP8=True)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and not _interpreting()


_NO_WINDOW = 1 << 30  # a window no sequence reaches: the kernels' "no sliding window"


def dot_precision(q: torch.Tensor) -> str:
    """The attention kernels' ``tl.dot`` input precision, from the dtype the products run in (the query's, which
    is the cache's unless the cache is FP8): "ieee" for float32 (no TF32 rounding of float32 operands), "tf32"
    (Triton's default; 16-bit operands ignore it) otherwise."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


class CudaTiles(NamedTuple):
    """Tile sizes and launch options of the attention kernels on CUDA for one head size."""

    prefill_block_m: int
    prefill_block_n: int
    prefill_warps: int
    decode_block_n: int
    decode_warps: int
    num_stages: int


def cuda_tiles(head_dim: int) -> CudaTiles:
    """The launchers' CUDA tiles for ``head_dim``. Up to 128: 64 x 64 prefill tiles, 64-key decode tiles,
    4 warps. Above 128 (Gemma 2/3: 256) the 64 x 64 tiles spill registers on sm_90, so prefill takes
    32 x 32 tiles on 8 warps and decode 32-key tiles on 4 warps (no spills; 34816 and 25600 bytes of
    shared memory in bfloat16)."""
    if head_dim <= 128:
        return CudaTiles(64, 64, 4, 64, 4, 2)
    return CudaTiles(32, 32, 8, 32, 4, 2)


def _window(window: int | None) -> int:
    if window is not None and window < 1:
        raise ValueError(f"window must be positive or None, got {window}")
    return _NO_WINDOW if window is None else min(window, _NO_WINDOW)


def _cache_strides(k_cache: torch.Tensor) -> tuple[int, int, int]:
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches (an FP8 cache:
    each head vector quantized, its scale written to ``kv_scales``).

    ``slot_mapping`` (int32/int64 ``[num_tokens]``): ``block_id * block_size + offset``; ``< 0`` is skipped.
    """
    _check_cache(k_cache, v_cache)
    _check_rows("key", key)
    _check_rows("value", value)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"K/V rows {tuple(key.shape)} do not match cache {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping is shorter than the number of K/V rows")
    scales = _scale_args(k_cache, kv_scales)
    if num_tokens == 0:
        return
    triton_jit._kv_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, scales.pop("k_scale_ptr"), scales.pop("v_scale_ptr"),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *_cache_strides(k_cache), **scales,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention. ``q``: ``[num_tokens, num_q_heads, head_dim]``; returns the same shape.
    ``window``: the query at position p sees keys p - window + 1..p only; ``softcap``: logits capped to
    softcap * tanh(s / softcap) before the softmax; ``kv_scales``: an FP8 cache's scales.

    ``cu_seqlens_q`` int32 ``[num_reqs + 1]``; ``seq_lens`` int32 ``[num_reqs]`` (context after this step,
    this step's K/V already in the cache); ``max_query_len`` is a host int (sizes the grid, no device sync).
    """
    _check_query(q, k_cache, v_cache)
    scales = _scale_args(k_cache, kv_scales)
    out = torch.empty_like(q) if out is None else out
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return out
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    on_cuda = _on_cuda(q)
    tiles = cuda_tiles(head_dim)
    bm = block_m or (tiles.prefill_block_m if on_cuda else 32)
    grid = (num_reqs, num_q_heads, triton.cdiv(max_query_len, bm))
    triton_jit._prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, scales.pop("k_scale_ptr"),
        scales.pop("v_scale_ptr"),
        (head_dim**-0.5 if scale is None else scale) * _LOG2E, (softcap or 0.0) * _LOG2E, _window(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *_cache_strides(k_cache), block_tables.stride(0),
        **scales, GROUP=num_q_heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=bm,
        BLOCK_N=block_n or (tiles.prefill_block_n if on_cuda else 32),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(q),
        **({"num_warps": tiles.prefill_warps, "num_stages": tiles.num_stages} if on_cuda else {}),
    )
    return out


# The split counts default_num_splits returns: NUM_SPLITS is a compile-time constant of the decode kernels,
# so a fixed set bounds their specialisations to len(SPLIT_BUCKETS) per shape.
SPLIT_BUCKETS = (1, 2, 4, 8, 16)


def default_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    min_split_len: int = 256,
    max_splits: int = 16,
) -> int:
    """Enough splits to give every SM ~2 programs, but no split shorter than ``min_split_len`` keys, rounded
    down to the nearest of ``SPLIT_BUCKETS``."""
    by_len = max(1, math.ceil(max_seq_len / min_split_len))
    by_occupancy = max(1, math.ceil(2 * num_sms / max(1, num_reqs * num_kv_heads)))
    want = min(max_splits, by_len, by_occupancy)
    return max((b for b in SPLIT_BUCKETS if b <= want), default=1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Split-KV paged decode (``window``, ``softcap``, ``kv_scales``: as :func:`prefill_attention`; the splits
    share the window's keys). ``q``: ``[num_reqs, num_q_heads, head_dim]`` (one token per request).

    Each request attends to keys ``0..seq_lens[r]-1``; a request with ``seq_len == 0`` (CUDA-graph padding)
    gets a zero output. ``num_splits`` is fixed per launch (see :func:`default_num_splits`).
    """
    _check_query(q, k_cache, v_cache)
    scales = _scale_args(k_cache, kv_scales)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    num_reqs, num_q_heads, head_dim = q.shape
    if num_reqs == 0:
        return out
    mid_o = torch.empty((num_reqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_reqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    scale = head_dim**-0.5 if scale is None else scale
    _decode_split(q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scale, block_n, window, softcap,
                  scales)
    block_d = max(16, triton.next_power_of_2(head_dim))
    triton_jit._decode_merge_kernel[(num_reqs, num_q_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        **({"num_warps": 4} if _on_cuda(q) else {}),
    )
    return out


def _decode_split(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor, scale: float, block_n: int | None,
    window: int | None, softcap: float | None, scales: dict[str, Any],
) -> None:
    """The split pass of :func:`decode_attention`: partial outputs and log-sum-exps into ``mid_o``/``mid_lse``
    (``scales``: ``_scale_args``)."""
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads, num_splits = k_cache.shape[2], mid_o.shape[2]
    group = num_q_heads // num_kv_heads
    on_cuda = _on_cuda(q)
    tiles = cuda_tiles(head_dim)
    launch: dict[str, Any] = {"num_warps": tiles.decode_warps, "num_stages": tiles.num_stages} if on_cuda else {}
    scales = dict(scales)
    triton_jit._decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scales.pop("k_scale_ptr"),
        scales.pop("v_scale_ptr"), scale * _LOG2E, (softcap or 0.0) * _LOG2E,
        _window(window), q.stride(0), q.stride(1), *_cache_strides(k_cache), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), **scales,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n or (tiles.decode_block_n if on_cuda else 32),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), SOFTCAP=softcap is not None,
        DOT_PRECISION=dot_precision(q), **launch,
    )
