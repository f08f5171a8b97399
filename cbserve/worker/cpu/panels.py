"""The packed weights of cbserve's CPU linear kernel as Python sees them (``Panels``: a format of
``csrc/panels.h`` and its bytes) and the checks of what the packers are given (``kernels.py`` packs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The k block of the quantized panel formats (PANEL_FORMATS: name -> the C enum, in abi.py).
BLOCK_FORMATS = ("q8_0", "q4_1", "q4_0")
BLOCK_K = 32
# GGUF's K-quants: super-blocks of 256 k values (float32 products only: no bfloat16-products variant).
KQUANT_FORMATS = ("q4_k", "q5_k", "q6_k")
KQUANT_K = 256
# The block formats whose products are float32 only (bfloat16 products keep them too): the K-quants and Q5_0.
FLOAT32_BLOCK_FORMATS = (*KQUANT_FORMATS, "q5_0")


@dataclass(frozen=True)
class Panels:
    """A [n, k] weight packed for ``CpuKernels.linear`` in one of the formats of csrc/cb_cpu.h (layouts in
    csrc/panels.h)."""

    fmt: str
    data: torch.Tensor  # uint8, the packed bytes
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def is_bfloat16_exact(weight: torch.Tensor) -> bool:
    """True when every float32 value of ``weight`` is a bfloat16 (its lower 16 bits are zero)."""
    return weight.dtype == torch.float32 and not bool(
        (weight.contiguous().view(torch.int32) & 0xFFFF).any()
    )


def block_shape(q: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor, fmt: str, block: int = BLOCK_K,
                multiple: int = BLOCK_K, scale_dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """[n, k] of block values ``q`` of ``dtype`` and their ``scales`` [n, k / block] of ``scale_dtype``, with k a
    multiple of ``multiple`` (ValueError otherwise)."""
    if q.dtype != dtype or q.dim() != 2 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError(f"{fmt} values must be a contiguous {dtype} CPU matrix, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if k % multiple or k == 0:
        raise ValueError(f"{fmt} needs k to be a multiple of {multiple}, got {k}")
    if (scales.dtype != scale_dtype or scales.shape != (n, k // block) or not scales.is_contiguous()
            or scales.device.type != "cpu"):
        raise ValueError(f"{fmt} scales must be a contiguous {scale_dtype} [{n}, {k // block}] CPU matrix, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    return n, k


def check_nibbles(q: torch.Tensor, fmt: str, top: int = 15) -> None:
    """ValueError when a block value (4 bits, or as many as ``top`` needs) is above ``top``."""
    if q.numel() and int(q.max()) > top:
        raise ValueError(f"{fmt} values must be in 0..{top}, got {int(q.max())}")
