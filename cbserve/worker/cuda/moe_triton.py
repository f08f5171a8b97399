"""The mixture-of-experts experts on CUDA as two grouped GEMMs (issue 37; vLLM's ``fused_moe`` idea), with no host
synchronisation and no Python loop over experts, so a decode step can be captured as a CUDA graph.

``moe_align_block_size`` sorts the (token, slot) pairs by expert on the device and pads every expert's run to a
multiple of ``BLOCK_M`` (padding entries hold ``n * k``, one past the last pair); each block of ``BLOCK_M`` entries
belongs to one expert. Its output sizes depend only on n * k, E and ``BLOCK_M``: the padded length is bounded on the
host by ``n * k + E * (BLOCK_M - 1)``, so the launch grids are fixed for a given token count; blocks past the real
padded length (a device scalar) return at once. One launch of ``_moe_gemm_kernel`` then computes every pair's
gate_up product against the stacked weight [E, 2I, H] (each block reads its expert's slice), ``silu_and_mul``
(triton_fused.py) follows, and a second launch the down products against [E, H, I]. The k rows of a token are
weighted and summed with the same batched product as ``moe.fused_experts``, so the two paths differ only in the
GEMMs' float32 accumulation order (float32 operands use IEEE products, no TF32).

This module imports triton at the top: ``moe.SparseMoeBlock`` imports it only in its CUDA branch
(``layers.use_triton``), so a CPU-only run never loads triton. Under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors, as the tests do; launch options are passed on CUDA only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from cbserve.worker.cuda.triton_fused import _launch, _round, silu_and_mul

SMALL_BATCH_PAIRS = 64  # up to this many (token, slot) pairs the blocks hold 16 rows, else 64


class MoETiles(NamedTuple):
    """Tiles and launch options of ``_moe_gemm_kernel``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int) -> MoETiles:
    """The tiles for ``num_pairs`` (token, slot) pairs: short blocks for decode batches (little padding per expert),
    longer ones for prefill. Both fit sm_90's shared memory without spills (checked by the compile test)."""
    if num_pairs <= SMALL_BATCH_PAIRS:
        return MoETiles(16, 64, 64, 4, 3)
    return MoETiles(64, 64, 64, 8, 3)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound of the padded length: each expert's run is padded by at most ``block_m - 1``."""
    return num_pairs + num_experts * (block_m - 1)


def moe_align_block_size(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [P], block_experts [P / block_m], num_padded [1]) of the expert ids [n, k], all on ids' device,
    P = ``max_padded_pairs`` rounded up to a multiple of ``block_m``. sorted_ids lists the pairs (t * k + slot)
    grouped by expert in increasing pair order, each expert's run padded to a multiple of ``block_m`` with
    ``n * k``; entries past ``num_padded`` are padding too. block_experts[b] is the expert of block b (E - 1 past
    the end, never read). Device ops only (scatter-add, not ``bincount``, which syncs on CUDA)."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    length = triton.cdiv(max_padded_pairs(num_pairs, num_experts, block_m), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat.index_select(0, order)
    first = counts.cumsum(0) - counts  # each expert's first position among the sorted pairs
    rank = torch.arange(num_pairs, device=ids.device) - first.index_select(0, expert)
    dest = (padded_end - padded).index_select(0, expert) + rank
    sorted_ids = torch.full((length,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, length, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr, n_cols, k_dim, num_pairs,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    ROW_DIV: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[p, :] = a[p // ROW_DIV, :] @ b[e]^T for the pairs p of one block of sorted_ids (expert e), one tile of
    BLOCK_N output columns per program: (block, column tile) grid. float32 accumulation, one rounding to c's
    dtype (to nearest, also under the interpreter). ``UPCAST`` (the interpreter only): 16-bit operands are
    converted to float32 before the IEEE dot, the same products and float32 sums. Blocks at or past num_padded,
    and padding entries, write nothing."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    mask_m = pair < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_cols
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        mask_k = offs_k + k0 < k_dim
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot of 16-bit floats is wrong; their products are exact in float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    dt = c_ptr.dtype.element_ty
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, _round(acc, dt).to(dt), mask=mask_m[:, None] & mask_n[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    row_div: int, tiles: MoETiles,
) -> None:
    """out[p] = a[p // row_div] @ w[expert(p)]^T for every pair p of ``align`` (``moe_align_block_size``)."""
    sorted_ids, block_experts, num_padded = align
    n_cols, k_dim = w.shape[1], w.shape[2]
    grid = (block_experts.shape[0], triton.cdiv(n_cols, tiles.block_n))
    launch = _launch(a, tiles.num_warps)
    if launch:
        launch["num_stages"] = tiles.num_stages
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_experts, num_padded, n_cols, k_dim, out.shape[0],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        ROW_DIV=row_div, DOT_PRECISION="ieee" if a.dtype == torch.float32 or not launch else "tf32",
        UPCAST=not launch,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **launch,
    )


def fused_moe(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """``moe.fused_experts`` on stacked weights: sum over k of ``weights[t, k] * expert_e(x[t])``, e = ids[t, k],
    expert_e(v) = w_down[e] @ (silu(gate) * up), [gate; up] = w_gate_up[e] @ v. x [n, H], w_gate_up [E, 2I, H],
    w_down [E, H, I] (this rank's shards under tensor parallelism: a partial sum, not all-reduced), weights and
    ids [n, k]. Three kernel launches plus device-side torch ops; no host synchronisation."""
    n, k = ids.shape
    num_experts, two_i, hidden = w_gate_up.shape
    if x.shape != (n, hidden) or w_down.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"fused_moe shapes do not fit: x {tuple(x.shape)}, ids {tuple(ids.shape)}, gate_up "
                         f"{tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"expert weights ({w_gate_up.dtype}, {w_down.dtype}) must be of x's dtype {x.dtype}")
    if n == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    tiles = moe_tiles(n * k)
    align = moe_align_block_size(ids, num_experts, tiles.block_m)
    gate_up = torch.empty(n * k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, align, k, tiles)
    act = silu_and_mul(gate_up)
    ys = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w_down, ys, align, 1, tiles)
    return torch.bmm(weights.unsqueeze(1).to(x.dtype), ys.view(n, k, hidden)).squeeze(1)
