"""Batched multi-LoRA on Triton: one shrink and one expand launch per layer for a whole mixed batch.

``add_lora_triton(y, x, a_stack, b_stack, token_slots)`` adds ``(x[t] @ A[s].T) @ B[s].T`` to ``y[t]`` for every
token ``t`` whose adapter slot ``s = token_slots[t]`` is ``>= 0``; base-model rows (slot ``-1``) are left as they
are. It is Punica's BGMV pair (kernels in ``lora_triton_jit.py``): the shrink writes a float32 intermediate
``[splits, T, R]`` (the input dim cut into ``splits`` parts when few tokens would leave the GPU idle), the expand
sums the splits and adds its float32 product into ``y`` with one rounding. Each token gathers its own slot, so
tokens need not be grouped or sorted, the launch shapes depend only on the tensor sizes (CUDA-graph friendly, no
device sync) and any mix of adapters costs the same two launches.

``add_lora_reference`` is the same operation in plain torch (float32, or float64 for float64 tensors): the
tests' reference and a readable statement of the contract.

Nothing here imports triton until ``add_lora_triton`` runs (the kernels module is imported then), so this module
imports on machines without it. On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (set before triton
is first imported), as the attention kernels' tests do.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

_SPLIT_BUCKETS = (1, 2, 4, 8, 16)  # split counts of the shrink's input dim (NUM_SPLITS is a constexpr)
_MIN_SPLIT_LEN = 1024  # no split of the input dim shorter than this many columns
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class LoraTiles(NamedTuple):
    """Tile sizes of the LoRA kernels for one rank (``shrink_block_r`` x ``shrink_block_k`` tiles of A,
    ``expand_block_n`` x ``expand_block_r`` tiles of B), and the warps of both."""

    shrink_block_r: int
    shrink_block_k: int
    expand_block_n: int
    expand_block_r: int
    num_warps: int


def cuda_tiles(rank: int) -> LoraTiles:
    """The launchers' CUDA tiles for ``rank``: tiles of about 4096 elements (16 float32 registers per thread
    and operand on 4 warps); rank tiles of 16 or 32 rows in the shrink (a rank of 8 pads to 16), up to 64 in
    the expand."""
    pow2 = max(16, 1 << max(0, rank - 1).bit_length())
    shrink_r = min(pow2, 32)
    expand_r = min(pow2, 64)
    return LoraTiles(shrink_r, 4096 // shrink_r, min(128, 4096 // expand_r), expand_r, 4)


# Under the interpreter: small tiles, so that the tests' small sizes still span several tiles and masked tails.
_INTERPRETER_TILES = LoraTiles(16, 32, 32, 16, 4)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_split_k(num_tokens: int, rank_blocks: int, in_features: int, num_sms: int = 132) -> int:
    """Splits of the shrink's input dim: enough programs for ~2 per SM, none shorter than ``_MIN_SPLIT_LEN``
    columns, rounded down to one of ``_SPLIT_BUCKETS`` (a prefill-sized batch gets 1)."""
    by_len = max(1, in_features // _MIN_SPLIT_LEN)
    by_occupancy = max(1, math.ceil(2 * num_sms / max(1, num_tokens * rank_blocks)))
    want = min(_SPLIT_BUCKETS[-1], by_len, by_occupancy)
    return max(b for b in _SPLIT_BUCKETS if b <= want)


def _check(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
           token_slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices of the contract; raises ValueError / TypeError."""
    if y.dim() != 2 or x.dim() != 2 or a_stack.dim() != 3 or b_stack.dim() != 3 or token_slots.dim() != 1:
        raise ValueError(
            f"want y [T, out], x [T, in], a_stack [S, R, in], b_stack [S, out, R], token_slots [T]; got "
            f"{tuple(y.shape)}, {tuple(x.shape)}, {tuple(a_stack.shape)}, {tuple(b_stack.shape)}, "
            f"{tuple(token_slots.shape)}"
        )
    (tokens, out_features), in_features = y.shape, x.shape[1]
    num_slots, rank = a_stack.shape[0], a_stack.shape[1]
    if x.shape[0] != tokens or token_slots.shape[0] != tokens:
        raise ValueError(f"y, x and token_slots disagree on the tokens: {y.shape[0]}, {x.shape[0]}, "
                         f"{token_slots.shape[0]}")
    if tuple(a_stack.shape) != (num_slots, rank, in_features) or tuple(b_stack.shape) != (
        num_slots, out_features, rank
    ):
        raise ValueError(f"a_stack {tuple(a_stack.shape)} / b_stack {tuple(b_stack.shape)} do not fit "
                         f"x {tuple(x.shape)} -> y {tuple(y.shape)}")
    if token_slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"token_slots must be int32 or int64, got {token_slots.dtype}")
    if y.dtype not in _FLOAT_DTYPES or x.dtype != y.dtype:
        raise TypeError(f"y and x must share a floating dtype, got {y.dtype} and {x.dtype}")
    if a_stack.dtype not in _FLOAT_DTYPES or b_stack.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"a_stack / b_stack must be floating, got {a_stack.dtype} / {b_stack.dtype}")
    devices = {t.device for t in (y, x, a_stack, b_stack, token_slots)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                       token_slots: torch.Tensor) -> None:
    """``add_lora_triton`` in plain torch: ``y[t] += (x[t] @ a_stack[s].T) @ b_stack[s].T`` for every token
    with slot ``0 <= s < S``, one matmul pair per adapter present, in float32 (float64 for float64 tensors)
    with one rounding into ``y``. Syncs with the device (it lists the slots present)."""
    _check(y, x, a_stack, b_stack, token_slots)
    acc = torch.promote_types(y.dtype, torch.float32)
    slots = token_slots.long()
    present = slots[(slots >= 0) & (slots < a_stack.shape[0])]
    for s in torch.unique(present).tolist():
        rows = (slots == s).nonzero().flatten()
        delta = (x[rows].to(acc) @ a_stack[s].to(acc).T) @ b_stack[s].to(acc).T
        y[rows] = (y[rows].to(acc) + delta).to(y.dtype)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                    token_slots: torch.Tensor, *, split_k: int | None = None,
                    tiles: LoraTiles | None = None) -> None:
    """y[t] += (x[t] @ a_stack[s].T) @ b_stack[s].T for every token t whose slot s = token_slots[t] >= 0;
    rows with slot -1 (the base model) are left as they are.

    y: [T, out] (float32/bfloat16/float16, modified in place; any strides, e.g. a column slice of a fused
    output); x: [T, in] same dtype; a_stack: [S, R, in]; b_stack: [S, out, R] (the scaling is already folded
    into B; unused rank rows/cols are zero); token_slots: int32 or int64 [T] on the same device. A slot
    ``>= S`` is skipped like ``-1`` (it is never read out of bounds). ``split_k`` (splits of the input dim,
    1..16) and ``tiles`` override the defaults (``default_split_k``, ``cuda_tiles``), for tests and tuning.
    """
    _check(y, x, a_stack, b_stack, token_slots)
    tokens, out_features = y.shape
    num_slots, rank, in_features = a_stack.shape
    if min(tokens, out_features, num_slots, rank, in_features) == 0:
        return
    from cbserve.worker.lora import triton_jit as jit  # looked up at each launch: the interpreter tests may reload it

    on_cuda = y.is_cuda and not _interpreting()
    t = tiles or (cuda_tiles(rank) if on_cuda else _INTERPRETER_TILES)
    rank_blocks = _cdiv(rank, t.shrink_block_r)
    if split_k is None:
        sms = torch.cuda.get_device_properties(y.device).multi_processor_count if on_cuda else 132
        split_k = default_split_k(tokens, rank_blocks, in_features, sms) if on_cuda else 1
    if not 1 <= split_k <= _SPLIT_BUCKETS[-1]:
        raise ValueError(f"split_k must be 1..{_SPLIT_BUCKETS[-1]}, got {split_k}")
    k_per_split = _cdiv(_cdiv(in_features, split_k), t.shrink_block_k) * t.shrink_block_k  # whole K tiles
    launch = {"num_warps": t.num_warps} if on_cuda else {}
    mid = torch.empty((split_k, tokens, rank), dtype=torch.float32, device=y.device)
    jit._lora_shrink_kernel[(tokens, rank_blocks, split_k)](
        x, a_stack, mid, token_slots, num_slots, in_features, rank, k_per_split,
        x.stride(0), x.stride(1), *a_stack.stride(), mid.stride(0), mid.stride(1),
        BLOCK_R=t.shrink_block_r, BLOCK_K=t.shrink_block_k, **launch,
    )
    jit._lora_expand_kernel[(tokens, _cdiv(out_features, t.expand_block_n))](
        mid, b_stack, y, token_slots, num_slots, out_features, rank,
        mid.stride(0), mid.stride(1), *b_stack.stride(), y.stride(0), y.stride(1),
        NUM_SPLITS=split_k, BLOCK_S=1 << (split_k - 1).bit_length(), BLOCK_N=t.expand_block_n,
        BLOCK_R=t.expand_block_r, **launch,
    )
