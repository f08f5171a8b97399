"""Packing GGUF's quantized blocks into the CPU linear kernel's panels (``csrc/panels.h``; the K-quants in
``csrc/kquants.c``): the packers ``CpuKernels`` has, each checking what its C packer relies on."""

from __future__ import annotations

from typing import Any

import torch

from cbserve.worker.cpu import abi
from cbserve.worker.cpu.abi import PANEL_FORMATS
from cbserve.worker.cpu.gguf_blocks import QuantBlocks
from cbserve.worker.cpu.panels import (
    BLOCK_FORMATS,
    BLOCK_K,
    KQUANT_FORMATS,
    KQUANT_K,
    Panels,
    block_shape,
    check_nibbles,
)


def check_scales(rc: int, what: str) -> None:
    """ValueError for a scale that is not a float16 value (or a value out of its range), else as ``abi.raise_for``."""
    if rc == abi.RETURN_CODES["CB_ERANGE"]:
        raise ValueError(f"{what}: a scale is not a float16 value, or a value is out of range (the GGUF block "
                         "formats keep float16 scales)")
    abi.raise_for(rc, what)


class BlockPackers:
    """The block packers over the loaded library ``_lib`` (``CpuKernels``)."""

    _lib: Any

    def _panels_out(self, fmt: str, n: int, k: int) -> torch.Tensor:
        size = int(self._lib.cb_packed_bytes(PANEL_FORMATS[fmt], n, k))
        if size < 0:
            multiple = BLOCK_K if fmt in BLOCK_FORMATS else KQUANT_K if fmt in KQUANT_FORMATS else 0
            raise ValueError(f"a [{n}, {k}] weight cannot be packed as {fmt}"
                             + (f" (k must be a multiple of {multiple})" if multiple else ""))
        return torch.empty(size, dtype=torch.uint8)

    def pack_q8_0(self, d: torch.Tensor, q: torch.Tensor) -> Panels:
        """W = d * q in blocks of 32 along k: d [n, k / 32] float32 holding float16 values (GGUF's scales; the
        panels keep them as float16: ValueError otherwise), q [n, k] int8."""
        n, k = block_shape(q, torch.int8, d, "q8_0")
        out = self._panels_out("q8_0", n, k)
        check_scales(self._lib.cb_pack_q8_0(d.data_ptr(), q.data_ptr(), n, k, out.data_ptr()), "pack_q8_0")
        return Panels("q8_0", out, n, k)

    def pack_q4_1(self, d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> Panels:
        """W = d * q + m in blocks of 32 along k: d, m [n, k / 32] float32 holding float16 values, q [n, k] uint8
        in 0..15."""
        n, k = block_shape(q, torch.uint8, d, "q4_1")
        block_shape(q, torch.uint8, m, "q4_1")
        check_nibbles(q, "q4_1")
        out = self._panels_out("q4_1", n, k)
        rc = self._lib.cb_pack_q4_1(d.data_ptr(), m.data_ptr(), q.data_ptr(), n, k, out.data_ptr())
        check_scales(rc, "pack_q4_1")
        return Panels("q4_1", out, n, k)

    def pack_q4_0(self, d: torch.Tensor, q: torch.Tensor) -> Panels:
        """W = d * (q - 8) in blocks of 32 along k: d [n, k / 32] float32 holding float16 values, q [n, k] uint8
        in 0..15."""
        n, k = block_shape(q, torch.uint8, d, "q4_0")
        check_nibbles(q, "q4_0")
        out = self._panels_out("q4_0", n, k)
        check_scales(self._lib.cb_pack_q4_0(d.data_ptr(), q.data_ptr(), n, k, out.data_ptr()), "pack_q4_0")
        return Panels("q4_0", out, n, k)

    def pack_q4_k(self, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                  q: torch.Tensor) -> Panels:
        """W = d * sc * q - dmin * m (GGUF Q4_K): d, dmin [n, k / 256] float32 holding float16 values, sc, m
        [n, k / 32] uint8 in 0..63, q [n, k] uint8 in 0..15."""
        return self._pack_q45_k("q4_k", d, dmin, sc, m, q)

    def pack_q5_0(self, d: torch.Tensor, q: torch.Tensor) -> Panels:
        """W = d * (q - 16) in blocks of 32 along k (GGUF Q5_0): d [n, k / 32] float32 holding float16 values, q
        [n, k] uint8 in 0..31."""
        n, k = block_shape(q, torch.uint8, d, "q5_0")
        check_nibbles(q, "q5_0", 31)
        out = self._panels_out("q5_0", n, k)
        check_scales(self._lib.cb_pack_q5_0(d.data_ptr(), q.data_ptr(), n, k, out.data_ptr()), "pack_q5_0")
        return Panels("q5_0", out, n, k)

    def pack_q5_k(self, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                  q: torch.Tensor) -> Panels:
        """As ``pack_q4_k`` with q in 0..31 (GGUF Q5_K)."""
        return self._pack_q45_k("q5_k", d, dmin, sc, m, q)

    def _pack_q45_k(self, fmt: str, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                    q: torch.Tensor) -> Panels:
        n, k = block_shape(q, torch.uint8, d, fmt, KQUANT_K, KQUANT_K)
        block_shape(q, torch.uint8, dmin, fmt, KQUANT_K, KQUANT_K)
        for sub in (sc, m):
            block_shape(q, torch.uint8, sub, fmt, BLOCK_K, KQUANT_K, torch.uint8)
            check_nibbles(sub, f"{fmt} sub-scales", 63)
        check_nibbles(q, fmt, 31 if fmt == "q5_k" else 15)
        out = self._panels_out(fmt, n, k)
        pack = self._lib.cb_pack_q5_k if fmt == "q5_k" else self._lib.cb_pack_q4_k
        check_scales(pack(d.data_ptr(), dmin.data_ptr(), sc.data_ptr(), m.data_ptr(), q.data_ptr(), n, k,
                          out.data_ptr()), f"pack_{fmt}")
        return Panels(fmt, out, n, k)

    def pack_q6_k(self, d: torch.Tensor, sc: torch.Tensor, q: torch.Tensor) -> Panels:
        """W = d * sc * (q - 32) (GGUF Q6_K): d [n, k / 256] float32 holding float16 values, sc [n, k / 16] int8,
        q [n, k] uint8 in 0..63."""
        n, k = block_shape(q, torch.uint8, d, "q6_k", KQUANT_K, KQUANT_K)
        block_shape(q, torch.uint8, sc, "q6_k", BLOCK_K // 2, KQUANT_K, torch.int8)
        check_nibbles(q, "q6_k", 63)
        out = self._panels_out("q6_k", n, k)
        check_scales(self._lib.cb_pack_q6_k(d.data_ptr(), sc.data_ptr(), q.data_ptr(), n, k, out.data_ptr()),
                     "pack_q6_k")
        return Panels("q6_k", out, n, k)

    def pack_blocks(self, blocks: QuantBlocks) -> Panels:
        """GGUF blocks packed in their panel format (Q8_0 as "q8_0", ..., Q6_K as "q6_k")."""
        packers = {"Q8_0": (self.pack_q8_0, blocks.q8_0), "Q4_0": (self.pack_q4_0, blocks.q4_0),
                   "Q4_1": (self.pack_q4_1, blocks.q4_1), "Q4_K": (self.pack_q4_k, blocks.q4_k),
                   "Q5_K": (self.pack_q5_k, blocks.q5_k), "Q6_K": (self.pack_q6_k, blocks.q6_k),
                   "Q5_0": (self.pack_q5_0, blocks.q5_0)}
        pack, unpacked = packers[blocks.qtype]
        return pack(*unpacked())
