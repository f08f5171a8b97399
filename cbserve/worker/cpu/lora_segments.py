"""A batch's rows grouped by LoRA adapter, checked once per step for the CPU LoRA kernel
(``CpuKernels.lora_add_``, csrc/lora.c)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRASegments:
    """A batch's rows grouped by adapter, for ``CpuKernels.lora_add_``: ``table`` [nseg, 4] int32, one row of
    (start row, rows, slot, columns used) a segment, checked once (``of``) for every layer of a step, with the
    bounds each call compares against its tensors: ``end`` (one past the last row covered), ``slots`` (one more
    than the highest slot named) and ``cols`` (the most columns used)."""

    table: torch.Tensor
    end: int
    slots: int
    cols: int

    @classmethod
    def of(cls, table: torch.Tensor) -> LoRASegments:
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] != 4 or not table.is_contiguous() \
                or table.device.type != "cpu":
            raise ValueError(f"LoRA segments must be a contiguous int32 CPU [nseg, 4] tensor of (start, rows, slot, "
                             f"cols), got {table.dtype} {tuple(table.shape)} on {table.device}")
        rows = table.tolist()
        if any(v < 0 for row in rows for v in row):
            raise ValueError(f"LoRA segments must not hold negative values: {rows}")
        return cls(table, max((r[0] + r[1] for r in rows), default=0), max((r[2] + 1 for r in rows), default=0),
                   max((r[3] for r in rows), default=0))
