"""Dynamic per-token FP8 quantization of a linear layer's input on CUDA, one Triton kernel (instead of the ~6 torch
kernels of ``fp8.quantize_rows``, its reference: the same formula). One program per row: the row's largest
magnitude in a first pass, the scaled values, rounded to e4m3 as torch rounds (``triton_jit.e4m3_grid``), in a
second (the row is read again from L2). Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbserve.worker.attention import triton_jit
from cbserve.worker.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)
MAX_BLOCK = 4096  # columns a program reads at once


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / _MAX, _MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        mask = start + offs < n_cols
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = triton_jit.e4m3_grid(tl.minimum(tl.maximum(x / scale, -_MAX), _MAX))
        tl.store(q_ptr + row * stride_q + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, n] (last dimension contiguous) as (e4m3 [tokens, n], float32 scales [tokens, 1])."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dimension, got {tuple(x.shape)} {x.stride()}")
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(MAX_BLOCK, triton.next_power_of_2(cols))
    launch = {"num_warps": 4 if block <= 1024 else 8} if x.is_cuda else {}
    _per_token_quant_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block, **launch)
    return q, scale
