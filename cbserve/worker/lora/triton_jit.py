"""The Triton kernels of batched multi-LoRA (``@triton.jit``); the launchers are in ``lora_triton.py``.

Punica's BGMV pair, every token gathering its own adapter slot (a mixed batch is one launch of each):

- ``_lora_shrink_kernel``: one program per (token, tile of rank rows, split of the input dim);
  ``mid[split, t, r] = sum_k x[t, k] * A[slot, r, k]`` over the split's part of the input dim, in float32.
  Splitting the long input dim gives decode batches (few tokens, 16k-wide rows) enough programs; the splits'
  partial sums are added by the expand kernel in a fixed order (deterministic, no atomics, no zeroing).
- ``_lora_expand_kernel``: one program per (token, tile of output columns);
  ``y[t, n] += sum_r (sum_split mid[split, t, r]) * B[slot, n, r]``, in float32, rounded once into ``y``.

A token whose slot is negative (the base model) or not below ``num_slots`` returns at once: base rows cost one
load of their slot and are never written. Token and slot offsets are computed in int64; every tile is masked,
so no size needs to be a power of two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, mid_ptr, slots_ptr, num_slots, in_features, rank, k_per_split,
    stride_x_tok, stride_x_in, stride_a_slot, stride_a_rank, stride_a_in, stride_m_split, stride_m_tok,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0)
    r_blk = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    tok64 = tok.to(tl.int64)
    offs_r = r_blk * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    x_row = x_ptr + tok64 * stride_x_tok
    a_rows = a_ptr + slot * stride_a_slot + offs_r[:, None].to(tl.int64) * stride_a_rank
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_row + offs_k * stride_x_in, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_rows + offs_k[None, :] * stride_a_in, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(mid_ptr + split * stride_m_split + tok64 * stride_m_tok + offs_r, acc, mask=r_mask)


@triton.jit
def _lora_expand_kernel(
    mid_ptr, b_ptr, y_ptr, slots_ptr, num_slots, out_features, rank,
    stride_m_split, stride_m_tok, stride_b_slot, stride_b_out, stride_b_rank, stride_y_tok, stride_y_out,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0)
    n_blk = tl.program_id(1)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    tok64 = tok.to(tl.int64)
    offs_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    mid_row = mid_ptr + tok64 * stride_m_tok + offs_s[:, None] * stride_m_split
    b_rows = b_ptr + slot * stride_b_slot + offs_n[:, None].to(tl.int64) * stride_b_out
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = tl.sum(tl.load(mid_row + offs_r[None, :], mask=s_mask[:, None] & r_mask[None, :], other=0.0), axis=0)
        b = tl.load(b_rows + offs_r[None, :] * stride_b_rank, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    y_ptrs = y_ptr + tok64 * stride_y_tok + offs_n * stride_y_out
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=n_mask)
