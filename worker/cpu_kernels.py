"""ctypes bindings of cbserve's CPU kernels (``csrc/``; built and loaded by ``cpu_native.py``).

Every method checks what the C code relies on (float32 CPU tensors, unit stride along rows, shapes that
agree) and raises ValueError otherwise, so a wrong call is an exception, never a stray memory access.
Outputs are new tensors unless a method says it works in place. ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

_ERRORS = {1: "out of memory for the kernel's scratch buffers", 2: "invalid shapes",
           3: "an index (sequence length, block id or position) outside its table"}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "cb_paged_decode_f32": [_P, _I64, _P, _I64, _P, _P, _I32, _P, _I64, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32],
    "cb_pack_weight_f32": [_P, _I64, _I32, _I32, _P],
    "cb_linear_f32": [_P, _I64, _I32, _I32, _P, _I32, _P, _P, _I64],
    "cb_add_rms_norm_f32": [_P, _I64, _P, _I64, _P, _F32, _P, _I64, _I32, _I32],
    "cb_silu_mul_f32": [_P, _I64, _I32, _I32, _P, _I64],
    "cb_rotary_f32": [_P, _I64, _I32, _I32, _I32, _P, _P, _P, _I64],
}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CPU kernel {what} failed: {_ERRORS.get(rc, f'error {rc}')}")


def _rows(t: torch.Tensor, name: str, cols: int | None = None) -> int:
    """The row stride of a float32 CPU matrix whose rows are contiguous (ValueError otherwise)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1):
        raise ValueError(f"{name} must be a float32 CPU matrix with contiguous rows, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {cols}")
    return max(t.stride(0), t.shape[1])


def _vector(t: torch.Tensor, name: str, n: int, dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or t.shape != (n,) or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU vector of {n}, got {t.dtype} {tuple(t.shape)}")


class CpuKernels:
    """The loaded library's kernels."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
        self._lib.cb_packed_size.restype = ctypes.c_int64
        self._lib.cb_packed_size.argtypes = [_I32, _I32]
        self.panel_width = int(self._lib.cb_gemm_panel_width())

    # ---- linear layers ----------------------------------------------------------------------------
    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A [n, k] float32 weight in the panel layout ``linear`` reads (a 1-D tensor of the same size,
        rounded up to whole panels)."""
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        ldw = _rows(weight, "weight")
        out = torch.empty(int(self._lib.cb_packed_size(n, k)), dtype=torch.float32)
        _check(self._lib.cb_pack_weight_f32(weight.data_ptr(), ldw, n, k, out.data_ptr()), "pack_weight")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for x [m, k], with ``packed = pack_weight(W)`` and W [n, k]."""
        m, k = x.shape if x.dim() == 2 else (0, 0)
        lda = _rows(x, "x")
        if packed.numel() != self._lib.cb_packed_size(n, k) or packed.dtype != torch.float32:
            raise ValueError(f"packed weight of {packed.numel()} floats does not fit n={n}, k={k}")
        if bias is not None:
            _vector(bias, "bias", n)
        out = torch.empty(m, n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        _check(self._lib.cb_linear_f32(x.data_ptr(), lda, m, k, packed.data_ptr(), n, bias_ptr, out.data_ptr(), n),
               "linear")
        return out

    # ---- elementwise ------------------------------------------------------------------------------
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual); the sum is written into ``residual`` in place.
        Without a residual: (RMSNorm(x) * weight, x)."""
        m, h = x.shape if x.dim() == 2 else (0, 0)
        ldx = _rows(x, "x")
        _vector(weight, "weight", h)
        ldr, r_ptr = 0, None
        if residual is not None:
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
            ldr, r_ptr = _rows(residual, "residual"), residual.data_ptr()
        out = torch.empty(m, h, dtype=torch.float32)
        _check(self._lib.cb_add_rms_norm_f32(x.data_ptr(), ldx, r_ptr, ldr, weight.data_ptr(), eps, out.data_ptr(),
                                             h, m, h), "add_rms_norm")
        return out, (x if residual is None else residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, 2 * inter] = [gate | up] -> silu(gate) * up [m, inter]."""
        ldx = _rows(x, "x")
        m, two_i = x.shape
        if two_i % 2:
            raise ValueError(f"silu_and_mul needs an even number of columns, got {two_i}")
        out = torch.empty(m, two_i // 2, dtype=torch.float32)
        _check(self._lib.cb_silu_mul_f32(x.data_ptr(), ldx, m, two_i // 2, out.data_ptr(), two_i // 2), "silu_mul")
        return out

    def rotary_(self, x: torch.Tensor, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> None:
        """Rotate x [m, heads * head_dim] in place (rotate-half convention) by ``positions`` [m] (int64),
        with cos/sin tables [max_positions, head_dim]."""
        ldx = _rows(x, "x")
        m, width = x.shape
        if head_dim < 2 or width % head_dim:
            raise ValueError(f"{width} columns are not whole heads of {head_dim}")
        _vector(positions, "positions", m, torch.int64)
        for name, table in (("cos", cos), ("sin", sin)):
            if _rows(table, name, head_dim) != head_dim or table.shape != cos.shape:
                raise ValueError(f"{name} must be a contiguous [max_positions, {head_dim}] table")
        _check(self._lib.cb_rotary_f32(x.data_ptr(), ldx, m, width // head_dim, head_dim, positions.data_ptr(),
                                       cos.data_ptr(), sin.data_ptr(), cos.shape[0]), "rotary")

    # ---- attention --------------------------------------------------------------------------------
    def paged_decode(
        self,
        q: torch.Tensor,  # [n, num_heads, head_dim] float32, heads contiguous within a row
        out: torch.Tensor,  # [n, num_heads, head_dim] float32, heads contiguous within a row
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [n, max_blocks] int32, rows contiguous
        seq_lens: torch.Tensor,  # [n] int32, contiguous
        max_seq_len: int,
        scale: float,
    ) -> None:
        """Attention of one query token per sequence over its cached keys/values; writes ``out``."""
        n, heads, dim = q.shape
        num_blocks, block_size, kv_heads, _ = k_cache.shape
        _check_heads(q, "q")
        _check_heads(out, "out")
        if out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[3] != dim:
            raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                             f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV cache must be contiguous")
        if any(t.dtype != torch.float32 for t in (q, out, k_cache, v_cache)):
            raise ValueError("the CPU decode kernel takes float32 tensors")
        if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            raise ValueError("block_tables and seq_lens must be int32 (seq_lens contiguous)")
        if block_tables.shape[0] != n or seq_lens.shape != (n,) or block_tables.stride(1) != 1:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                             f"do not match {n} sequences")
        if max_seq_len > block_tables.shape[1] * block_size:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_tables.shape[1]} blocks)")
        if n == 0:
            return
        rc = self._lib.cb_paged_decode_f32(
            q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            num_blocks, block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), n, heads, kv_heads,
            dim, block_size, scale, max_seq_len,
        )
        _check(rc, "paged decode")


def _check_heads(t: torch.Tensor, name: str) -> None:
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU [n, heads, dim] tensor with each row's heads contiguous")
