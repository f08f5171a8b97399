"""Fused Triton kernels of the CUDA decoder layer (issue 37): residual add + RMSNorm, the rotary embedding of q
and k, SiLU-and-mul and GeLU(tanh)-and-mul. One launch each instead of a handful of torch elementwise ops.

Each kernel keeps the rounding of the torch path it replaces (``layers.RMSNorm``, ``rotary.apply_rotary``,
``layers.SiluAndMul`` / ``GeluTanhAndMul``): float32 arithmetic, rounded to the tensors' dtype (float32, bfloat16
or float16) wherever torch rounds, so a bfloat16 model gives the same numbers up to the float32 reduction order
of the norm and the last bit of ``exp``. A row is normed in one tile up to ``MAX_NORM_TILE`` columns, longer ones
(Llama-3-405B's 16384) in two passes over tiles, so that no tile spills registers.

This module imports triton at the top: the layers import it only inside their CUDA branch (``layers.use_triton``),
so a CPU-only run never loads triton. On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (set before
triton is first imported), as the tests do; launch options (warps) are passed only on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

_MAX_HEAD_TILE = 1024  # elements of one half of the rotary tile (heads x head_dim/2) per program
MAX_NORM_TILE = 8192  # longer rows are normed in tiles of half this, in two passes (_add_rms_norm_long_kernel)
_ACT_BLOCK = 1024  # output columns per program of the activation kernels
SILU, GELU_TANH = 0, 1  # ACT of _act_and_mul_kernel


@triton.jit
def _round(x, dt: tl.constexpr):
    """float32 x rounded to ``dt`` (to nearest, ties to even), kept in float32. bfloat16 by integer arithmetic on
    the bits: the same result as the GPU's conversion, and also under the interpreter, which truncates on a
    ``.to(tl.bfloat16)``; a later ``.to(dt)`` of the result is exact either way."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        # float16 by the same arithmetic (a plain x.to(float16).to(float32) after a product lets the compiler fold
        # both into float16 arithmetic, which it may contract to fma.rn.f16): 10 mantissa bits in the normal
        # range; below 2**-14, float16's subnormals, the fixed quantum 2**-24 by adding and removing 0.75.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13
        normal = bits.to(tl.float32, bitcast=True)
        return tl.where(tl.abs(x) < 6.103515625e-05, (x + 0.75) - 0.75, normal)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, heads, eps,
    stride_x_tok, stride_x_head, stride_x_col, stride_r_tok, stride_r_col, stride_o_row,
    HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per row (row = token * heads + head). With a residual: s = x + r rounded to the dtype and
    written into r; then out = rms_norm(s) * w. ``ROUND_NORMED`` (RMSNorm's plain form): the normed row is rounded
    to the dtype before the product with w (HF's order); else (Gemma's 1 + w, float32) one rounding at the end."""
    row = tl.program_id(0).to(tl.int64)
    tok = row // heads
    head = row % heads
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    x_ptrs = x_ptr + tok * stride_x_tok + head * stride_x_head + cols * stride_x_col
    xf = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + tok * stride_r_tok + cols * stride_r_col
        xf = _round(xf + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), dt)
        tl.store(r_ptrs, xf.to(dt), mask=mask)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = xf * rstd
    if ROUND_NORMED:
        normed = _round(normed, dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o_row + cols, _round(normed * w, dt).to(dt), mask=mask)


@triton.jit
def _add_rms_norm_long_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, stride_x_tok, stride_x_col, stride_r_tok, stride_r_col,
    stride_o_row, HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``_add_rms_norm_kernel`` for rows longer than one tile ([tokens, hidden] only): a first pass over tiles of
    the row writes the sum into the residual and sums the squares, a second reads the sum (or x) back and norms
    it. Each thread reads back the elements it wrote (the same tile layout in both passes)."""
    row = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    x_row = x_ptr + row * stride_x_tok
    r_row = res_ptr + row * stride_r_tok
    sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        xf = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            xf = _round(xf + tl.load(r_row + cols * stride_r_col, mask=mask, other=0.0).to(tl.float32), dt)
            tl.store(r_row + cols * stride_r_col, xf.to(dt), mask=mask)
        sq += xf * xf
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / n_cols + eps)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        if HAS_RESIDUAL:
            xf = tl.load(r_row + cols * stride_r_col, mask=mask, other=0.0).to(tl.float32)
        else:
            xf = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
        normed = xf * rstd
        if ROUND_NORMED:
            normed = _round(normed, dt)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o_row + cols, _round(normed * w, dt).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, heads, stride_x_tok, stride_x_head, stride_x_col, stride_cs_row,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """In place, rotate-half (neox) convention: x1' = x1 c1 - x2 s1, x2' = x2 c2 + x1 s2 for the halves x1, x2 of
    each head, with c, s the float32 table rows of the token's position rounded to x's dtype, and each product
    and the sum rounded to the dtype (the torch path's order). One program per (token, tile of heads)."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    cs_row = pos * stride_cs_row
    c1 = _round(tl.load(cos_ptr + cs_row + offs_d, mask=d_mask, other=0.0), dt)
    c2 = _round(tl.load(cos_ptr + cs_row + HALF + offs_d, mask=d_mask, other=0.0), dt)
    s1 = _round(tl.load(sin_ptr + cs_row + offs_d, mask=d_mask, other=0.0), dt)
    s2 = _round(tl.load(sin_ptr + cs_row + HALF + offs_d, mask=d_mask, other=0.0), dt)
    mask = (offs_h < heads)[:, None] & d_mask[None, :]
    p1 = x_ptr + tok * stride_x_tok + offs_h[:, None].to(tl.int64) * stride_x_head + offs_d[None, :] * stride_x_col
    p2 = p1 + HALF * stride_x_col
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    a1 = _round(x1 * c1[None, :], dt)
    b1 = _round(-x2 * s1[None, :], dt)
    a2 = _round(x2 * c2[None, :], dt)
    b2 = _round(x1 * s2[None, :], dt)
    tl.store(p1, _round(a1 + b1, dt).to(dt), mask=mask)
    tl.store(p2, _round(a2 + b2, dt).to(dt), mask=mask)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_x_row, stride_x_col, stride_o_row,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[r, j] = act(x[r, j]) * x[r, inter + j]; act (SiLU, or GeLU with the tanh approximation) in float32,
    rounded to the dtype before the product (torch's order). One program per (row, tile of columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x_row
    g = tl.load(x_row + cols * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + (inter + cols) * stride_x_col, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    else:  # torch's 0.5 g (1 + tanh(y)); tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|) in (0, 1]: no overflow
        y = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(y < 0, -t, t))
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o_row + cols, _round(_round(a, dt) * u, dt).to(dt), mask=mask)


def _launch(x: torch.Tensor, num_warps: int) -> dict[str, Any]:
    """Launch options on CUDA (the interpreter takes none): the warps, and no fused multiply-adds, so that each
    product and sum is rounded as the torch path rounds it (with fusion, a float16 ``a * c - b * s`` becomes one
    ``fma.rn.f16``, which differs from torch where the two products cancel; measured on an H200)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return {"num_warps": num_warps, "enable_fp_fusion": False} if x.is_cuda and not interpreting else {}


def norm_tiles(n_cols: int, max_tile: int = MAX_NORM_TILE) -> tuple[int, int, bool]:
    """(BLOCK_N, num_warps, long) of the norm for rows of ``n_cols``: the whole row in one tile with about 16
    float32 values per thread (4 to 16 warps); rows longer than ``max_tile`` (``long``: the two-pass kernel) in
    tiles of half of it on 8 warps. No register spills on sm_90 (checked by the compile test)."""
    block = triton.next_power_of_2(n_cols)
    if block > max_tile:
        return max_tile // 2, 8, True
    return block, max(4, min(16, block // 512)), False


def rotary_tiles(heads: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_D) of the rotary kernel: tiles of whole head halves, at most ``_MAX_HEAD_TILE`` elements."""
    block_d = triton.next_power_of_2(head_dim // 2)
    return max(1, min(triton.next_power_of_2(heads), _MAX_HEAD_TILE // block_d)), block_d


def act_block(inter: int) -> int:
    """BLOCK of the activation kernels: columns of one program."""
    return min(_ACT_BLOCK, triton.next_power_of_2(inter))


def _rms_norm_rows(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool,
    max_tile: int = MAX_NORM_TILE,
) -> torch.Tensor:
    """The norm of every row of x [tokens, cols] or [tokens, heads, cols] (any strides); out: a new contiguous
    tensor of x's shape. With ``residual`` (x's shape, 2-D) the sum x + residual is written into it first."""
    *lead, n_cols = x.shape
    tokens, heads = (lead[0], 1) if x.dim() == 2 else (lead[0], lead[1])
    if weight.shape != (n_cols,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of {n_cols}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block, warps, long = norm_tiles(n_cols, max_tile)
    r = residual if residual is not None else x
    flags: dict[str, Any] = dict(HAS_RESIDUAL=residual is not None, ROUND_NORMED=not gemma, BLOCK_N=block,
                                 **_launch(x, warps))
    if long and x.dim() == 2:
        _add_rms_norm_long_kernel[(tokens,)](
            x, r, weight, out, n_cols, eps, x.stride(0), x.stride(1), r.stride(0), r.stride(-1), n_cols, **flags
        )
        return out
    stride_x_head = x.stride(1) if x.dim() == 3 else 0
    if long:
        flags["BLOCK_N"] = triton.next_power_of_2(n_cols)  # per-head rows (q/k norms) are short in practice
    _add_rms_norm_kernel[(tokens * heads,)](
        x, r, weight, out, n_cols, heads, eps, x.stride(0), stride_x_head, x.stride(-1), r.stride(0), r.stride(-1),
        n_cols, **flags,
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, gemma: bool = False,
    max_tile: int = MAX_NORM_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in one launch: (rms_norm(x + residual) * weight, x + residual), the sum written into
    ``residual`` in place; without a residual (rms_norm(x) * weight, x). x, residual: [tokens, hidden] of one
    dtype; weight: [hidden], in x's dtype, or float32 with ``gemma`` (Gemma's stored 1 + w: one rounding after
    the float32 product instead of rounding the normed row first). ``max_tile``: rows longer than this are
    normed in two passes (tests set it low to reach that kernel at small sizes)."""
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm wants x [tokens, hidden], got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    out = _rms_norm_rows(x, residual, weight, eps, gemma, max_tile)
    return out, (x if residual is None else residual)


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """``RMSNorm.norm_heads``: the norm over the last dim of x [tokens, heads, head_dim] (any strides, e.g. q's
    columns of the fused qkv output), a new contiguous tensor."""
    if x.dim() != 3:
        raise ValueError(f"rms_norm_heads wants x [tokens, heads, head_dim], got {tuple(x.shape)}")
    return _rms_norm_rows(x, None, weight, eps, gemma)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary(x, cos[positions], sin[positions])`` in place, returns x. x: [tokens, heads, head_dim] (last
    dim contiguous or not; e.g. the q and k heads of the fused qkv output together), positions: [tokens] int32 or
    int64, cos/sin: the float32 tables [max_positions, head_dim] (``RotaryEmbedding``), rows read at positions."""
    if x.dim() != 3 or positions.shape != (x.shape[0],):
        raise ValueError(f"rotary_ wants x [tokens, heads, head_dim] and positions [tokens], got "
                         f"{tuple(x.shape)} and {tuple(positions.shape)}")
    tokens, heads, head_dim = x.shape
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit head_dim {head_dim}")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos and sin must be row-major tables of the same layout")
    if x.numel() == 0:
        return x
    half = head_dim // 2
    block_h, block_d = rotary_tiles(heads, head_dim)
    _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
        x, positions, cos, sin, heads, x.stride(0), x.stride(1), x.stride(2), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, **_launch(x, 4),
    )
    return x


def act_and_mul(x: torch.Tensor, act: int) -> torch.Tensor:
    """act(gate) * up of x [..., 2 * inter] = [gate | up] (act: ``SILU`` or ``GELU_TANH``), a new [..., inter]."""
    if act not in (SILU, GELU_TANH):
        raise ValueError(f"unknown activation {act}")
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"act_and_mul needs an even number of columns, got {two_i}")
    inter = two_i // 2
    rows = x.reshape(-1, two_i)  # a view for the layers' outputs (contiguous rows or a 2-D slice)
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = act_block(inter)
        _act_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows, out, inter, rows.stride(0), rows.stride(1), out.stride(0), ACT=act, BLOCK=block,
            **_launch(x, 4),
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [..., 2 * inter] = [gate | up]."""
    return act_and_mul(x, SILU)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of x [..., 2 * inter] = [gate | up]."""
    return act_and_mul(x, GELU_TANH)
