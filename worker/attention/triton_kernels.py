"""Triton kernels for paged attention, plus thin Python launchers.

Three jobs, one kernel each (two for decode: split pass + merge):

- ``write_kv_cache``: scatter this step's K/V rows into the paged cache at ``slot_mapping``
  (``slot = block_id * block_size + offset``); rows with ``slot < 0`` (padding) are skipped.
- ``prefill_attention``: varlen causal attention over the flattened batch. Request ``r`` owns query rows
  ``cu_seqlens_q[r]:cu_seqlens_q[r+1]``; its K/V (cached prefix *and* this step's new tokens, already
  written) live in the paged cache behind ``block_tables[r]``. The query at position ``p`` (``p`` counts from
  the start of the sequence, so prefix-cache hits and chunked prefill are the same case) attends to keys
  ``0..p``. ``seq_lens[r]`` is the request's total context after this step.
- ``decode_attention``: one query token per request, split-KV ("flash decoding"): each program covers one
  (request, KV head, split) and all query heads of that KV head at once (GQA), partial results are merged
  with a log-sum-exp reduction. The number of splits is a launch constant, so the launch is shape-stable
  (CUDA-graph friendly): each request's split length is computed in-kernel from its own ``seq_len``.

Cache layout, per layer: K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a contiguous
last dimension; ``block_tables`` is int32 ``[num_reqs, max_blocks]``. Page offsets are computed in int64.
Softmax runs in fp32 in the exp2 domain. The kernels run natively on CUDA and, at small sizes, on CPU
tensors under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) free of NaN. Globals read inside
# @triton.jit must be tl.constexpr (the compiler rejects plain Python globals; the interpreter does not).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    tok64 = tok.to(tl.int64)
    k_src = key_ptr + tok64 * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    v_src = value_ptr + tok64 * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    k = tl.load(k_src, mask=mask)
    v = tl.load(v_src, mask=mask)
    dst = blk * stride_c_blk + off * stride_c_off + offs_h[:, None] * stride_c_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_blk = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    if m_blk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens before this step's first query (cached prefix / earlier chunks)
    kv_head = head // GROUP

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = ctx_len + offs_m

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, ctx_len + (m_blk + 1) * BLOCK_M)  # causal: last key this tile needs
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = page * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )
        s = tl.dot(q, k) * qk_scale
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_bt,
    stride_mo_req,
    stride_mo_head,
    stride_mo_split,
    stride_ml_req,
    stride_ml_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    req64 = req.to(tl.int64)
    q = tl.load(
        q_ptr + req64 * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + req64 * stride_bt
    for kv_start in range(start, end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_off = page * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0
        )
        s = tl.dot(q, k) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 domain
    mo = mid_o_ptr + req64 * stride_mo_req + heads[:, None] * stride_mo_head + split * stride_mo_split
    tl.store(mo + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + req64 * stride_ml_req + heads * stride_ml_head + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_mo_req,
    stride_mo_head,
    stride_mo_split,
    stride_ml_req,
    stride_ml_head,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        mid_lse_ptr + req * stride_ml_req + head * stride_ml_head + offs_s, mask=s_mask, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (padded request): weights all 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    o = tl.load(
        mid_o_ptr
        + req * stride_mo_req
        + head * stride_mo_head
        + offs_s[:, None] * stride_mo_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + req * stride_o_tok + head * stride_o_head + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# ----------------------------------------------------------------------------------------------- launchers


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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches.

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
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
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
) -> torch.Tensor:
    """Varlen causal paged attention. ``q``: ``[num_tokens, num_q_heads, head_dim]``; returns the same shape.

    ``cu_seqlens_q`` int32 ``[num_reqs + 1]``; ``seq_lens`` int32 ``[num_reqs]`` (context after this step,
    this step's K/V already in the cache); ``max_query_len`` is a host int (sizes the grid, no device sync).
    """
    _check_cache(k_cache, v_cache)
    _check_rows("q", q)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"q heads {num_q_heads}/head_dim {head_dim} incompatible with cache {tuple(k_cache.shape)}"
        )
    out = torch.empty_like(q) if out is None else out
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return out
    scale = head_dim**-0.5 if scale is None else scale
    on_cuda = q.is_cuda and not _interpreting()
    bm = block_m or (64 if on_cuda else 32)
    bn = block_n or (64 if on_cuda else 32)
    grid = (num_reqs, num_q_heads, triton.cdiv(max_query_len, bm))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **({"num_warps": 4, "num_stages": 2} if on_cuda else {}),
    )
    return out


def default_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    min_split_len: int = 256,
    max_splits: int = 16,
) -> int:
    """Enough splits to give every SM ~2 programs, but no split shorter than ``min_split_len`` keys."""
    by_len = max(1, math.ceil(max_seq_len / min_split_len))
    by_occupancy = max(1, math.ceil(2 * num_sms / max(1, num_reqs * num_kv_heads)))
    return int(min(max_splits, by_len, by_occupancy))


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
) -> torch.Tensor:
    """Split-KV paged decode. ``q``: ``[num_reqs, num_q_heads, head_dim]`` (one token per request).

    Each request attends to keys ``0..seq_lens[r]-1``; a request with ``seq_len == 0`` (CUDA-graph padding)
    gets a zero output. ``num_splits`` is fixed per launch (see :func:`default_num_splits`).
    """
    _check_cache(k_cache, v_cache)
    _check_rows("q", q)
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"q heads {num_q_heads}/head_dim {head_dim} incompatible with cache {tuple(k_cache.shape)}"
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    if num_reqs == 0:
        return out
    scale = head_dim**-0.5 if scale is None else scale
    group = num_q_heads // num_kv_heads
    on_cuda = q.is_cuda and not _interpreting()
    bn = block_n or (64 if on_cuda else 32)
    block_d = max(16, triton.next_power_of_2(head_dim))
    mid_o = torch.empty((num_reqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_reqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    launch = {"num_warps": 4, "num_stages": 2} if on_cuda else {}
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=bn,
        BLOCK_D=block_d,
        **launch,
    )
    _decode_merge_kernel[(num_reqs, num_q_heads)](
        mid_o,
        mid_lse,
        out,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        **({"num_warps": 4} if on_cuda else {}),
    )
    return out
