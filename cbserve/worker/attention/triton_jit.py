"""The Triton kernels of paged attention (``@triton.jit``); the launchers are in ``triton_kernels.py``.

- ``_kv_write_kernel``: one program per token; scatters its K/V heads to ``slot`` (``< 0``: skipped).
- ``_prefill_kernel``: one program per (request, query head, tile of query rows); causal over the request's
  cached prefix and this step's tokens, read from the paged cache.
- ``_decode_split_kernel`` + ``_decode_merge_kernel``: one query token per request, split-KV ("flash
  decoding"): each program covers one (request, KV head, split) and all query heads of that KV head (GQA);
  the merge combines the splits' partial results with a log-sum-exp reduction.

Both attention kernels take a sliding window (the keys before it are skipped, tile by tile, and masked) and
an optional logit soft-cap. Both run the same online-softmax step over one tile of keys (``_attend_tile``), in fp32
in the exp2 domain (``qk_scale`` includes log2(e)). Page offsets are computed in int64. ``DOT_PRECISION`` is
the ``input_precision`` of their ``tl.dot``s: "ieee" for float32 caches (full float32 products, no TF32),
"tf32" (Triton's default, which 16-bit operands ignore) otherwise.

``KV_FP8``: the caches hold e4m3 values with one float32 scale per (slot, KV head) in ``k_scale_ptr`` /
``v_scale_ptr`` (``[num_blocks, block_size, num_kv_heads]``, strides ``stride_s_blk``, ``stride_s_off``; see
``kv_fp8.py``). The write kernel quantizes each head vector (``_fp8_rows``, the formula of ``fp8.quantize_rows``);
the attention kernels convert a tile to the query's dtype and apply the scales to the logits (keys) and to the
softmax weights (values), so the dot products run on the 16-bit (or float32) tensor-core path unchanged. Without
it the scale pointers are placeholders that are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) free of NaN. Globals read inside
# @triton.jit must be tl.constexpr (the compiler rejects plain Python globals; the interpreter does not).
_NEG_BIG = tl.constexpr(-1.0e30)
_FP8_MAX = tl.constexpr(448.0)  # fp8.FP8_MAX
_FP8_MIN_SCALE = tl.constexpr(1.0 / (448.0 * 512.0))  # fp8.MIN_SCALE


@triton.jit
def e4m3_grid(y):
    """float32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even (as torch's cast): the e4m3 cast
    of the result is exact, the same on every target and in the interpreter (whose own cast rounds ties up and
    drops the carry into the exponent: 127.9 became 64). The step of y's binade is 2^(e - 3) (3 mantissa bits),
    2^-9 below 2^-6 (the subnormals); adding and removing 1.5 * 2^23 steps rounds to a multiple of it."""
    exp = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exp + 124) << 23).to(tl.float32, bitcast=True)
    magic = step * 12582912.0
    return (y + magic) - magic


@triton.jit
def _fp8_rows(x, scale_ptrs, row_mask):
    """Rows of ``x`` scaled into e4m3's range and rounded to its values (to be stored as e4m3), their scales stored
    at ``scale_ptrs``."""
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), 1) / _FP8_MAX, _FP8_MIN_SCALE)
    tl.store(scale_ptrs, scale, mask=row_mask)
    return e4m3_grid(tl.minimum(tl.maximum(xf / scale[:, None], -_FP8_MAX), _FP8_MAX))


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_c_blk, stride_c_off, stride_c_head,
    stride_s_blk, stride_s_off,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
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
    k = tl.load(k_src, mask=mask, other=0.0)
    v = tl.load(v_src, mask=mask, other=0.0)
    dst = blk * stride_c_blk + off * stride_c_off + offs_h[:, None] * stride_c_head + offs_d[None, :]
    if KV_FP8:
        s_dst = blk * stride_s_blk + off * stride_s_off + offs_h
        k = _fp8_rows(k, k_scale_ptr + s_dst, offs_h < NUM_KV_HEADS)
        v = _fp8_rows(v, v_scale_ptr + s_dst, offs_h < NUM_KV_HEADS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, keep, offs_d, d_mask, m_i, l_i, acc, qk_scale, softcap,
    stride_c_blk, stride_c_off, kv_head_off, k_scale_ptr, v_scale_ptr, stride_s_blk, stride_s_off, kv_head,
    BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One online-softmax step of ``q`` (rows x head dim) over the keys ``offs_n`` of a paged sequence
    (``n_mask``: keys that exist; ``keep``: rows x keys allowed, e.g. causal). Returns (m_i, l_i, acc).
    ``SOFTCAP``: the logits are capped to softcap * tanh(s / softcap) first (``softcap`` in the exp2 domain,
    i.e. times log2(e), like ``qk_scale``). ``KV_FP8``: e4m3 tiles, dequantized by their per-key scales."""
    page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    kv_off = page * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off + kv_head_off
    k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    if KV_FP8:
        s_off = page * stride_s_blk + (offs_n % BLOCK_SIZE) * stride_s_off + kv_head
        k_scale = tl.load(k_scale_ptr + s_off, mask=n_mask, other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * (k_scale[None, :] * qk_scale)
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # cap * tanh(s / cap) = cap - 2 cap / (exp(2 s / cap) + 1); s and cap both carry log2(e)
        e = tl.exp2(s * (2.0 * 1.4426950408889634 / softcap))
        s = softcap - (2.0 * softcap) / (e + 1.0)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:  # sum_n p[m, n] * (s_n * v[n, :]) = sum_n (p[m, n] * s_n) * v[n, :]
        v_scale = tl.load(v_scale_ptr + s_off, mask=n_mask, other=0.0)
        pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,  # KV_FP8: the caches' scales
    qk_scale,  # softmax scale * log2(e)
    softcap,  # logit soft-cap * log2(e) (read when SOFTCAP)
    window,  # sliding window: a query at position p sees keys p - window + 1..p (a huge number: no window)
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_c_blk, stride_c_off, stride_c_head,
    stride_bt, stride_s_blk, stride_s_off,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
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
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    q_pos = ctx_len + offs_m

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, ctx_len + (m_blk + 1) * BLOCK_M)  # causal: last key this tile needs
    # sliding window: the first key this tile's first query sees, rounded down to a tile of keys
    kv_start = tl.maximum(ctx_len + m_blk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        keep = (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - window) & n_mask[None, :]
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, keep, offs_d, d_mask, m_i, l_i, acc, qk_scale,
            softcap, stride_c_blk, stride_c_off, kv_head * stride_c_head, k_scale_ptr, v_scale_ptr, stride_s_blk,
            stride_s_off, kv_head, BLOCK_SIZE, SOFTCAP, DOT_PRECISION, KV_FP8,
        )
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, k_scale_ptr,
    v_scale_ptr, qk_scale, softcap, window, stride_q_tok, stride_q_head, stride_c_blk, stride_c_off, stride_c_head,
    stride_bt, stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head, stride_s_blk,
    stride_s_off,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    lo = tl.maximum(seq_len - window, 0)  # the first key of the sliding window (0 without one)
    split_len = tl.cdiv(seq_len - lo, NUM_SPLITS)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    req64 = req.to(tl.int64)
    q = tl.load(
        q_ptr + req64 * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_H], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + req64 * stride_bt
    for kv_start in range(start, end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, bt_row, offs_n, n_mask, n_mask[None, :], offs_d, d_mask, m_i, l_i, acc,
            qk_scale, softcap, stride_c_blk, stride_c_off, kv_head * stride_c_head, k_scale_ptr, v_scale_ptr,
            stride_s_blk, stride_s_off, kv_head, BLOCK_SIZE, SOFTCAP, DOT_PRECISION, KV_FP8,
        )
    has = l_i > 0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 domain
    mo = mid_o_ptr + req64 * stride_mo_req + heads[:, None] * stride_mo_head + split * stride_mo_split
    tl.store(mo + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + req64 * stride_ml_req + heads * stride_ml_head + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head, stride_o_tok, stride_o_head,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
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
        mid_o_ptr + req * stride_mo_req + head * stride_mo_head + offs_s[:, None] * stride_mo_split
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    out = out_ptr + req * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=d_mask)
