"""The C kernels' multi-LoRA product with bfloat16 products (csrc/lora.c's ``cb_lora_add_bf16``,
``CpuKernels.lora_add_`` with bfloat16 slots): x rounded to bfloat16, A and B^T bfloat16, x A^T rounded to
bfloat16 before the expand, float32 sums. Checked against a float64 product of the same rounded operands on every
ISA build this machine runs (the f32 tests' mixed segments, odd sizes, strided rows), the same results on any
thread count, the torch fallback's semantics (``lora._product``) and the argument checks.

Where x A^T falls within float32 summation error of a point halfway between two bfloat16 values, the kernel may
round it either way (its sums are float32, the reference's float64): the bound allows either neighbour there
and only float32 summation error elsewhere."""

from __future__ import annotations

import ctypes

import pytest
import test_isa_levels
import torch
from test_cpu_lora_kernel import (
    MIXED,
    UNTOUCHED,
    _adapters,
    _prefill_and_decode,
    _reference,
    _table,
    outputs_on_1_and_2_threads,
)

from cbserve.worker.cpu import abi
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.lora_segments import LoRASegments
from cbserve.worker.lora.manager import _product

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

builds = test_isa_levels.builds  # the kernels built at every ISA level this CPU runs

Segments = list[tuple[int, int, int, int]]


def _bf16_adapters(slots: int, cmax: int, fan_in: int, fan_out: int, used: list[int],
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, bt = _adapters(slots, cmax, fan_in, fan_out, used, gen)
    return a.bfloat16(), bt.bfloat16()


def _rounded_reference(x: torch.Tensor, y0: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                       segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 reference, allowed distance) of y0 + bf16(bf16(x) @ A^T) @ B^T per segment (see the docstring)."""
    ref, tol = y0.double().clone(), 1e-6 + 1e-5 * y0.double().abs()
    for start, rows, slot, cols in segments:
        if rows and cols:
            xs = x[start : start + rows].bfloat16().double()
            a64, b64 = a[slot, :cols].double(), bt[slot, :cols].double()
            t = xs @ a64.t()
            # float32 sums of products in lanes of >= 4, then the lanes: a bound on the kernel's error in t
            err = (x.shape[1] / 4 + 32) * 2.0**-24 * (xs.abs() @ a64.abs().t())
            lo, mid, hi = ((t + d).to(torch.bfloat16).double() for d in (-err, 0.0, err))
            ref[start : start + rows] += mid @ b64
            tol[start : start + rows] += (hi - lo) @ b64.abs() + 1e-5 * (mid.abs() @ b64.abs())
    return ref, tol


def _check(y: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    excess = (y.double() - ref[0]).abs() - ref[1]
    assert (excess <= 0).all(), f"{what}: {int((excess > 0).sum())} values off, worst by {excess.max().item():.3g}"


@pytest.mark.parametrize("fan_in,fan_out,cmax", [(100, 75, 24), (576, 960, 48), (17, 3, 24), (64, 129, 31)])
def test_mixed_segments_every_level(builds: dict[str, CpuKernels], fan_in: int, fan_out: int, cmax: int) -> None:
    gen = torch.Generator().manual_seed(fan_in + fan_out)
    segments = [(s, r, slot, min(c, cmax)) for s, r, slot, c in MIXED]
    a, bt = _bf16_adapters(5, cmax, fan_in, fan_out, [16, 24, 24, 7, 0], gen)
    x, y0 = torch.randn(70, fan_in, generator=gen), torch.randn(70, fan_out, generator=gen)
    ref = _rounded_reference(x, y0, a, bt, segments)
    unrounded = _reference(x, y0, a.float(), bt.float(), segments)  # x and t not rounded: float32 products
    for level, kernels in builds.items():
        y = y0.clone()
        assert kernels.lora_add_(x, y, a, bt, _table(segments)) is y
        _check(y, ref, level)
        assert torch.equal(y[UNTOUCHED], y0[UNTOUCHED]), level
        assert ((y.double() - unrounded).abs() > ref[1]).any(), level  # the rounding is real: the check can fail


def test_strided_x_and_y_leave_the_rest_of_their_matrices_alone(builds: dict[str, CpuKernels]) -> None:
    gen = torch.Generator().manual_seed(1)
    a, bt = _bf16_adapters(3, 24, 100, 75, [24, 9, 20], gen)
    wide_x, wide_y = torch.randn(30, 130, generator=gen), torch.randn(30, 90, generator=gen)
    x, y_view = wide_x[:, 7:107], wide_y[:, 11:86]
    segments = [(20, 10, 1, 9), (0, 13, 0, 24), (13, 4, 2, 20)]
    ref = _rounded_reference(x, y_view, a, bt, segments)
    for level, kernels in builds.items():
        y_wide = wide_y.clone()
        kernels.lora_add_(x, y_wide[:, 11:86], a, bt, LoRASegments.of(_table(segments)))
        _check(y_wide[:, 11:86], ref, level)
        assert torch.equal(y_wide[:, :11], wide_y[:, :11]) and torch.equal(y_wide[:, 86:], wide_y[:, 86:]), level
        assert torch.equal(wide_x[:, 7:107], x)


@pytest.mark.parametrize("segments", [_prefill_and_decode(), [(0, 12, 3, 48)]], ids=["prefill+decode", "12-rows"])
def test_results_do_not_depend_on_the_thread_count(kernels: CpuKernels, segments: Segments) -> None:
    gen = torch.Generator().manual_seed(2)
    a, bt = _bf16_adapters(16, 48, 576, 960, [48] * 8 + [16] * 8, gen)
    m = max(start + rows for start, rows, _, _ in segments)
    x, y0 = torch.randn(m, 576, generator=gen), torch.randn(m, 960, generator=gen)
    outs = outputs_on_1_and_2_threads(kernels, x, y0, a, bt, segments)
    assert torch.equal(outs[0], outs[1])
    _check(outs[0], _rounded_reference(x, y0, a, bt, segments), "threads")


def test_the_torch_fallback_has_the_kernels_rounding(kernels: CpuKernels) -> None:
    """LoRALinear without the C kernels (``_product``), bfloat16 slots on a float32 model: the same rounded
    operands, so the same bound."""
    gen = torch.Generator().manual_seed(4)
    a, bt = _bf16_adapters(1, 40, 333, 200, [40], gen)
    x, y0 = torch.randn(9, 333, generator=gen), torch.randn(9, 200, generator=gen)
    ref = _rounded_reference(x, y0, a, bt, [(0, 9, 0, 40)])
    _check(y0 + _product(x, a[0], bt[0]), ref, "torch")
    _check(kernels.lora_add_(x, y0.clone(), a, bt, _table([(0, 9, 0, 40)])), ref, "kernel")
    assert _product(x, a[0].float(), bt[0].float()).dtype == torch.float32  # float32 slots: float32 products


def _ok() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(8, 16), "y": torch.randn(8, 12), "a": torch.randn(3, 4, 16).bfloat16(),
            "bt": torch.randn(3, 4, 12).bfloat16(), "segments": _table([(0, 4, 1, 4)])}


@pytest.mark.parametrize("case", [
    ("bt float32", {"bt": torch.randn(3, 4, 12)}, "bt must be"),
    ("a float32", {"a": torch.randn(3, 4, 16)}, "bt must be"),
    ("float16", {"a": torch.randn(3, 4, 16).half(), "bt": torch.randn(3, 4, 12).half()}, "a must be"),
    ("x bfloat16", {"x": torch.randn(8, 16).bfloat16()}, "x must be a float32"),
    ("y bfloat16", {"y": torch.randn(8, 12).bfloat16()}, "y must be a float32"),
    ("a not contiguous", {"a": torch.randn(3, 16, 4).bfloat16().transpose(1, 2)}, "a must be"),
    ("no such slot", {"segments": _table([(0, 2, 3, 4)])}, "slot 3"),
], ids=lambda c: c[0])
def test_bad_arguments_are_value_errors(kernels: CpuKernels, case: tuple[str, dict[str, object], str]) -> None:
    args = _ok()
    y_before = args["y"].clone()
    args.update(case[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=case[2]):
        kernels.lora_add_(**args)  # type: ignore[arg-type]
    if "y" not in case[1]:
        assert torch.equal(args["y"], y_before)  # nothing written


def test_the_c_entry_point_checks_what_it_can(kernels: CpuKernels) -> None:
    """Straight through ctypes: bad sizes are CB_EINVAL, bad or overlapping segments CB_ERANGE."""
    x, y = torch.randn(8, 16), torch.zeros(8, 12)
    a, bt = torch.randn(2, 4, 16).bfloat16(), torch.randn(2, 4, 12).bfloat16()
    fn = kernels._lib.cb_lora_add_bf16

    def call(seg: Segments, cmax: int = 4, ldx: int = 16) -> int:
        table = _table(seg)
        return fn(x.data_ptr(), ldx, y.data_ptr(), 12, 16, 12, a.data_ptr(), bt.data_ptr(), cmax,
                  ctypes.c_void_p(table.data_ptr()), table.shape[0])

    codes = abi.RETURN_CODES
    assert call([(0, 8, 1, 4)]) == codes["CB_OK"]
    assert call([(0, 8, 1, 4)], ldx=15) == call([(0, 8, 1, 4)], cmax=1537) == codes["CB_EINVAL"]
    assert call([(0, 2, 0, 5)]) == call([(0, -2, 0, 4)]) == call([(2, 3, 0, 4), (4, 1, 1, 1)]) == codes["CB_ERANGE"]
    _check(y, _rounded_reference(x, torch.zeros(8, 12), a, bt, [(0, 8, 1, 4)]), "ctypes")
