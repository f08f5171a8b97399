"""Python wrappers of cbserve's CPU kernels (``csrc/``; built and loaded by ``native.py``, the ctypes
signatures bound and checked against ``csrc/cb_cpu.h`` by ``abi.py``).

Every method checks what the C code relies on (float32 CPU tensors, unit stride along rows, shapes that
agree) and raises ValueError otherwise, so a wrong call is an exception, never a stray memory access.
Outputs are new tensors unless a method says it works in place. ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from cbserve.worker.cpu import abi
from cbserve.worker.cpu.abi import INT16_ROWS_FORMATS, ModelArgs, format_code
from cbserve.worker.cpu.abi import raise_for as _check
from cbserve.worker.cpu.block_packing import BlockPackers
from cbserve.worker.cpu.lora_segments import LoRASegments
from cbserve.worker.cpu.panels import BLOCK_FORMATS, BLOCK_K, Panels, is_bfloat16_exact

__all__ = ["BLOCK_FORMATS", "BLOCK_K", "CpuKernels", "Panels", "is_bfloat16_exact"]


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


_LORA_DTYPES = (torch.float32, torch.bfloat16)  # of the LoRA kernel's adapter slots (bfloat16: bf16 products)
LORA_MAX_COLS = 1536  # columns of a LoRA slot (csrc/lora.c): rank 512 of a fused q/k/v projection, 3 x 512


class CpuKernels(BlockPackers):
    """The loaded library's kernels (``abi.AbiMismatch`` when its header and the ctypes table disagree)."""

    def __init__(self, path: Path, header: Path = abi.HEADER, isa: str = "") -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        abi.bind(self._lib, header)
        self.panel_width = int(self._lib.cb_gemm_panel_width())
        bits = int(self._lib.cb_isa_features())
        # what the library was compiled for, from its own report: e.g. ("avx2", "avx512", "avx512_bf16")
        self.isa_features = tuple(name for name, bit in abi.ISA_FEATURES.items() if bits & bit)
        self.isa = isa or ("avx512" if "avx512" in self.isa_features else "avx2" if "avx2" in self.isa_features
                           else "scalar")

    # ---- linear layers ----------------------------------------------------------------------------
    def pack_weight(self, weight: torch.Tensor, fmt: str = "f32") -> Panels:
        """A [n, k] float32 weight packed as "f32"; as "bf16" when every value is a bfloat16 (its lower 16
        bits zero: ValueError otherwise); or as "bf16_dot", rounded to bfloat16, for bfloat16 products."""
        n, k = weight.shape if weight.dim() == 2 else (0, 0)
        ldw = _rows(weight, "weight")
        packers = {"f32": self._lib.cb_pack_weight_f32, "bf16": self._lib.cb_pack_weight_bf16,
                   "bf16_dot": self._lib.cb_pack_weight_bf16_dot}
        if fmt not in packers:
            raise ValueError(f"pack_weight packs {sorted(packers)}, not {fmt!r}")
        if fmt == "bf16" and not is_bfloat16_exact(weight):
            raise ValueError("the weight has values that are not bfloat16: packing it as bf16 would round them")
        out = self._panels_out(fmt, n, k)
        _check(packers[fmt](weight.data_ptr(), ldw, n, k, out.data_ptr()), "pack_weight")
        return Panels(fmt, out, n, k)

    @staticmethod
    def with_bf16_products(panels: Panels) -> Panels:
        """GGUF block panels ("q8_0", "q4_1", "q4_0") read for bfloat16 products: the same bytes, each decoded weight
        rounded to bfloat16 by the kernel (the products of "bf16_dot" panels of the decoded weight)."""
        if panels.fmt not in BLOCK_FORMATS:
            raise ValueError(f"only {BLOCK_FORMATS} panels have a bfloat16-products variant, not {panels.fmt!r}")
        return Panels(f"{panels.fmt}_bf16", panels.data, panels.n, panels.k)

    def with_int16_rows(self, panels: Panels, every_row: bool = False) -> Panels:
        """4-8-bit block panels (``INT16_ROWS_FORMATS``) whose few-row products (decode steps: 1-4 rows with AVX-512,
        1-2 with AVX2) round each row to int16 per 32 values and sum integer products (csrc/rows_i16.c): a new
        packing of the same size and weights, each block's values regrouped as int16 pairs (csrc/i16.h), and the
        same products for more rows; within 2^-16 of each block's largest input of the float32 product.
        ``every_row``: every step's rows are rounded so, prefills' too (format "<fmt>_i16all")."""
        if panels.fmt not in INT16_ROWS_FORMATS:
            raise ValueError(f"only {INT16_ROWS_FORMATS} panels have an int16-rows variant, not {panels.fmt!r}")
        self._check_panels(panels)
        out = torch.empty_like(panels.data)
        _check(self._lib.cb_repack_i16(format_code(panels.fmt), panels.data.data_ptr(), panels.n, panels.k,
                                       out.data_ptr()), "repack_i16")
        return Panels(f"{panels.fmt}_i16{'all' if every_row else ''}", out, panels.n, panels.k)

    def unpack(self, panels: Panels) -> torch.Tensor:
        """The [n, k] float32 weight the kernel multiplies by (for checks and tests)."""
        self._check_panels(panels)
        out = torch.empty(panels.n, panels.k, dtype=torch.float32)
        _check(self._lib.cb_unpack_panels(format_code(panels.fmt), panels.data.data_ptr(), panels.n, panels.k,
                                          out.data_ptr(), panels.k), "unpack")
        return out

    def linear(self, x: torch.Tensor, panels: Panels, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for x [m, k], with W [n, k] packed as ``panels``."""
        m, k = x.shape if x.dim() == 2 else (0, 0)
        lda = _rows(x, "x")
        self._check_panels(panels)
        if k != panels.k:
            raise ValueError(f"x has {k} columns but the packed weight does not fit: it is [{panels.n}, {panels.k}]")
        if bias is not None:
            _vector(bias, "bias", panels.n)
        out = torch.empty(m, panels.n, dtype=torch.float32)
        bias_ptr = None if bias is None else bias.data_ptr()
        _check(self._lib.cb_linear(format_code(panels.fmt), x.data_ptr(), lda, m, k, panels.data.data_ptr(),
                                   panels.n, bias_ptr, out.data_ptr(), panels.n), "linear")
        return out

    def set_amx(self, enable: bool) -> bool:
        """Let blocks of 4 rows or more of bfloat16 products run on Intel AMX tiles (the default where the CPU,
        the build and the OS allow it) or not; returns whether they do from now on. Process-wide."""
        return bool(self._lib.cb_set_amx(int(enable)))

    def set_rows(self, enable: bool) -> bool:
        """Let steps of 1-4 rows of float32 products multiply the weights decoded in registers (the default) or
        not (the tiled path of bigger steps; the same results bit for bit); returns the setting before. Process-wide."""
        return bool(self._lib.cb_set_rows(int(enable)))

    def _check_panels(self, panels: Panels) -> None:
        try:
            code = format_code(panels.fmt)
        except KeyError:
            code = -1
        size = self._lib.cb_packed_bytes(code, panels.n, panels.k)
        if panels.data.dtype != torch.uint8 or panels.data.numel() != size or not panels.data.is_contiguous():
            raise ValueError(f"packed weight of {panels.data.numel()} {panels.data.dtype} does not fit a "
                             f"{panels.fmt} [{panels.n}, {panels.k}] packing")

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

    def _gated(self, fn: Callable[..., int], x: torch.Tensor, what: str) -> torch.Tensor:
        """x [m, 2 * inter] = [gate | up] -> act(gate) * up [m, inter] by the C kernel ``fn``."""
        ldx = _rows(x, "x")
        m, two_i = x.shape
        if two_i % 2:
            raise ValueError(f"{what} needs an even number of columns, got {two_i}")
        out = torch.empty(m, two_i // 2, dtype=torch.float32)
        _check(fn(x.data_ptr(), ldx, m, two_i // 2, out.data_ptr(), two_i // 2), what)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, 2 * inter] = [gate | up] -> silu(gate) * up [m, inter]."""
        return self._gated(self._lib.cb_silu_mul_f32, x, "silu_and_mul")

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, 2 * inter] = [gate | up] -> gelu(gate, tanh approximation) * up [m, inter]."""
        return self._gated(self._lib.cb_gelu_tanh_mul_f32, x, "gelu_tanh_and_mul")

    def apply_token_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """In place: every token of ``logits`` [rows, vocab] float32 whose bit in ``bitmask`` [rows,
        >= ceil(vocab / 32)] int32 (xgrammar's layout) is 0 set to -inf; returns ``logits``."""
        rows, vocab = logits.shape if logits.dim() == 2 else (0, 0)
        ld = _rows(logits, "logits")
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != rows or bitmask.stride(1) != 1:
            raise ValueError(f"bitmask must be an int32 [{rows}, >= {(vocab + 31) // 32}] matrix with contiguous rows, "
                             f"got {bitmask.dtype} {tuple(bitmask.shape)}")
        _check(self._lib.cb_apply_token_bitmask_f32(logits.data_ptr(), ld, rows, vocab, bitmask.data_ptr(),
                                                    bitmask.stride(0)), "apply_token_bitmask")
        return logits

    def top_p_threshold(self, probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
        """[rows, 1] float32: each row's least nucleus probability for its top_p (0: the row kept whole) of
        ``probs`` [rows, vocab] float32 (non-negative)."""
        ld = _rows(probs, "probs")
        rows, vocab = probs.shape
        if len(top_ps) != rows:
            raise ValueError(f"{len(top_ps)} top_p values for {rows} rows")
        p_t = torch.tensor(top_ps, dtype=torch.float32)
        out = torch.empty(rows, 1, dtype=torch.float32)
        _check(self._lib.cb_top_p_threshold_f32(probs.data_ptr(), ld, rows, vocab, p_t.data_ptr(), out.data_ptr()),
               "top_p_threshold")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows] int64: each row's index of its largest value in ``x`` [rows, n] float32, the first on ties
        (``x.max(dim=-1).indices``, NaN included), without torch's scalar reduction loop."""
        ld = _rows(x, "x")
        rows, n = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        _check(self._lib.cb_argmax_f32(x.data_ptr(), ld, rows, n, out.data_ptr()), "argmax")
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

    # ---- multi-LoRA -------------------------------------------------------------------------------
    def lora_add_(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                  segments: torch.Tensor | LoRASegments) -> torch.Tensor:
        """In place, one linear layer's adapters for a batch grouped by adapter: ``y[r] += (x[r] @ a[slot, :cols].T)
        @ bt[slot, :cols]`` for the rows r of each segment (start, rows, slot, cols); returns ``y``. x [m, in], y [m,
        out] float32, rows contiguous (y not overlapping x); a [slots, cmax, in], bt [slots, cmax, out] (B^T, scaled)
        contiguous, cmax <= 1536, both float32 or both bfloat16 (bfloat16 products, csrc/cb_cpu.h). Segments ([nseg, 4]
        int32, or ``LoRASegments.of`` it once a step): disjoint, in the m rows, slot < slots, cols <= cmax."""
        seg = segments if isinstance(segments, LoRASegments) else LoRASegments.of(segments)
        xs, ys, as_, bs = x.shape, y.shape, a.shape, bt.shape
        # one expression on the common path (called per adapted layer and step); the details only on failure
        if not (x.dtype == y.dtype == torch.float32 and a.dtype == bt.dtype in _LORA_DTYPES and x.is_cpu and y.is_cpu
                and a.is_cpu and bt.is_cpu and len(xs) == len(ys) == 2 and len(as_) == len(bs) == 3 and xs[0] == ys[0]
                and as_[2] == xs[1] >= 1 and bs[2] == ys[1] >= 1 and as_[:2] == bs[:2] and 1 <= as_[1] <= LORA_MAX_COLS
                and (x.stride(1) == 1 or xs[1] == 1) and (y.stride(1) == 1 or ys[1] == 1)
                and a.is_contiguous() and bt.is_contiguous()):
            _lora_complaint(x, y, a, bt)
        if seg.end > xs[0] or seg.slots > as_[0] or seg.cols > as_[1]:
            raise ValueError(f"LoRA segments reach row {seg.end}, slot {seg.slots - 1} and {seg.cols} columns: "
                             f"beyond x's {xs[0]} rows, a's {as_[0]} slots or its {as_[1]} columns")
        fn = self._lib.cb_lora_add_f32 if a.dtype == torch.float32 else self._lib.cb_lora_add_bf16
        rc = fn(x.data_ptr(), max(x.stride(0), xs[1]), y.data_ptr(), max(y.stride(0), ys[1]), xs[1], ys[1],
                a.data_ptr(), bt.data_ptr(), as_[1], seg.table.data_ptr(), seg.table.shape[0])
        if rc == abi.RETURN_CODES["CB_ERANGE"]:
            raise ValueError(f"LoRA segments overlap: {seg.table.tolist()}")
        _check(rc, "lora_add")
        return y

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
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Attention of one query token per sequence over its cached keys/values (its last ``window`` ones with
        a sliding window; logits capped to ``softcap * tanh(s / softcap)`` with ``softcap``); writes ``out``."""
        if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
            raise ValueError(f"window must be positive or None and softcap positive or None: {window}, {softcap}")
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
            dim, block_size, scale, max_seq_len, window or 0, softcap or 0.0,
        )
        _check(rc, "paged decode")

    def llama_layers(
        self, model: ModelArgs, layers: ctypes.Array, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
    ) -> None:
        """Every decoder layer for one step (csrc/layers.c), in place: x [n, hidden] holds the token
        embeddings on entry and the final hidden states on return; one row of ``block_tables`` / ``seq_lens``
        per token. The caller (layers.py) built ``model`` and ``layers`` from live tensors and keeps them
        alive."""
        n = x.shape[0] if x.dim() == 2 else -1
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape != (n, model.hidden):
            raise ValueError(f"x must be a contiguous float32 [n, {model.hidden}] tensor, got {x.dtype} "
                             f"{tuple(x.shape)}")
        _vector(positions, "positions", n, torch.int64)
        _vector(slots, "slot_mapping", n, torch.int64)
        _vector(seq_lens, "seq_lens", n, torch.int32)
        if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != n \
                or block_tables.stride(1) != 1 or block_tables.device.type != "cpu":
            raise ValueError(f"block_tables must be int32 [{n}, max_blocks] with contiguous rows")
        if max_seq_len > block_tables.shape[1] * model.block_size:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the block table ({block_tables.shape[1]} blocks)")
        if len(layers) != model.num_layers:
            raise ValueError(f"{len(layers)} layers given for a model of {model.num_layers}")
        _check(self._lib.cb_llama_layers(ctypes.byref(model), layers, n, x.data_ptr(), positions.data_ptr(),
                                          slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                                          seq_lens.data_ptr(), max_seq_len), "llama layers")


def _lora_complaint(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    """The ValueError of ``CpuKernels.lora_add_``'s tensors, which its one-line check found wrong."""
    _rows(x, "x")
    _rows(y, "y")
    if y.shape[0] != x.shape[0] or x.shape[1] < 1 or y.shape[1] < 1:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [m, in] and [m, out], in, out >= 1")
    for name, t, width in (("a", a, x.shape[1]), ("bt", bt, y.shape[1])):
        if t.dtype != a.dtype or a.dtype not in _LORA_DTYPES or t.device.type != "cpu" or t.dim() != 3 \
                or not t.is_contiguous() or t.shape[2] != width or t.shape[:2] != a.shape[:2]:
            raise ValueError(f"{name} must be a contiguous float32 or bfloat16 CPU [slots, cmax, {width}] tensor (a "
                             f"and bt alike), got {t.dtype} {tuple(t.shape)} (a is {a.dtype} {tuple(a.shape)})")
    raise ValueError(f"a and bt have {a.shape[1]} columns a slot: at least 1 and at most {LORA_MAX_COLS} (rank 512 "
                     "of a fused q/k/v projection)")


def _check_heads(t: torch.Tensor, name: str) -> None:
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU [n, heads, dim] tensor with each row's heads contiguous")
