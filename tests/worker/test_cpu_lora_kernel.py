"""The C kernels' multi-LoRA product (csrc/lora.c, ``CpuKernels.lora_add_``): one call adds every adapter of a
mixed batch to one linear layer's output, against a float64 torch reference, on every ISA build this machine
runs (segments out of order, partly used slots, rows of no segment, strided x and y, odd sizes), slots of up to
3 x 512 columns (rank 512 of a fused q/k/v projection: taken 512 columns at a time, each y element still summed in
column order, so equal bit for bit to adding the chunks one call after another), the same results on any thread
count, and the argument checks."""

from __future__ import annotations

import ctypes

import pytest
import test_isa_levels
import torch

from cbserve.worker.cpu import abi
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.lora_segments import LoRASegments

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

LEVELS = cpu_native.supported_levels()


builds = test_isa_levels.builds  # the kernels built at every ISA level this CPU runs


def _adapters(slots: int, cmax: int, fan_in: int, fan_out: int, used: list[int],
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """a [slots, cmax, in], bt [slots, cmax, out]; slot s uses its first used[s] columns, the rest is NaN (a
    kernel that reads past cols gives NaN)."""
    a = torch.randn(slots, cmax, fan_in, generator=gen) / fan_in**0.5
    bt = torch.randn(slots, cmax, fan_out, generator=gen)
    for s, cols in enumerate(used):
        a[s, cols:] = float("nan")
        bt[s, cols:] = float("nan")
    return a, bt


def _reference(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
               segments: list[tuple[int, int, int, int]]) -> torch.Tensor:
    ref = y.double().clone()
    for start, rows, slot, cols in segments:
        if rows and cols:
            xs = x[start : start + rows].double()
            ref[start : start + rows] += (xs @ a[slot, :cols].double().t()) @ bt[slot, :cols].double()
    return ref


def _table(segments: list[tuple[int, int, int, int]]) -> torch.Tensor:
    return torch.tensor(segments, dtype=torch.int32).reshape(-1, 4)


# (start, rows, slot, cols): out of order, a gap of rows in no segment (and rows after the last), two
# segments of one slot, slot 3 at less than its width, a segment with no rows and one with no columns, short
# segments (the kernel splits their expand over the columns)
MIXED = [(40, 9, 2, 24), (0, 5, 0, 16), (5, 1, 3, 7), (23, 17, 0, 16), (6, 0, 1, 24), (49, 3, 4, 0), (52, 11, 1, 24),
         (63, 2, 2, 24), (65, 3, 1, 24)]
UNTOUCHED = [*range(6, 23), *range(49, 52), *range(68, 70)]


@pytest.mark.parametrize("fan_in,fan_out,cmax", [(100, 75, 24), (576, 960, 48), (17, 3, 24), (64, 129, 31)])
def test_mixed_segments_every_level(builds: dict[str, CpuKernels], fan_in: int, fan_out: int, cmax: int) -> None:
    gen = torch.Generator().manual_seed(fan_in + fan_out)
    segments = [(s, r, slot, min(c, cmax)) for s, r, slot, c in MIXED]
    a, bt = _adapters(5, cmax, fan_in, fan_out, [16, 24, 24, 7, 0], gen)
    x, y0 = torch.randn(70, fan_in, generator=gen), torch.randn(70, fan_out, generator=gen)
    ref = _reference(x, y0, a, bt, segments)
    for level, kernels in builds.items():
        y = y0.clone()
        assert kernels.lora_add_(x, y, a, bt, _table(segments)) is y
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5, msg=level)
        assert torch.equal(y[UNTOUCHED], y0[UNTOUCHED]), level


def test_strided_x_and_y_leave_the_rest_of_their_matrices_alone(builds: dict[str, CpuKernels]) -> None:
    gen = torch.Generator().manual_seed(1)
    a, bt = _adapters(3, 24, 100, 75, [24, 9, 20], gen)
    wide_x, wide_y = torch.randn(30, 130, generator=gen), torch.randn(30, 90, generator=gen)
    x, y_view = wide_x[:, 7:107], wide_y[:, 11:86]
    segments = [(20, 10, 1, 9), (0, 13, 0, 24), (13, 4, 2, 20)]
    ref = _reference(x, y_view, a, bt, segments)
    for level, kernels in builds.items():
        y_wide = wide_y.clone()
        kernels.lora_add_(x, y_wide[:, 11:86], a, bt, LoRASegments.of(_table(segments)))
        torch.testing.assert_close(y_wide[:, 11:86].double(), ref, rtol=1e-5, atol=1e-5, msg=level)
        assert torch.equal(y_wide[:, :11], wide_y[:, :11]) and torch.equal(y_wide[:, 86:], wide_y[:, 86:]), level
        assert torch.equal(wide_x[:, 7:107], x)


def _prefill_and_decode() -> list[tuple[int, int, int, int]]:
    """One long (prefill) segment among 16 decode segments of 1-4 rows."""
    segments, row = [], 0
    for slot in range(16):
        rows = 700 if slot == 5 else 1 + slot % 4
        segments.append((row, rows, slot, 48 if slot < 8 else 16))
        row += rows
    return segments[::-1]


# the second: one segment of 12 rows, in items of 8 rows on one thread and of 4 rows on two
@pytest.mark.parametrize("segments", [_prefill_and_decode(), [(0, 12, 3, 48)]], ids=["prefill+decode", "12-rows"])
def test_results_do_not_depend_on_the_thread_count(
    kernels: CpuKernels, segments: list[tuple[int, int, int, int]]
) -> None:
    gen = torch.Generator().manual_seed(2)
    a, bt = _adapters(16, 48, 576, 960, [48] * 8 + [16] * 8, gen)
    m = max(start + rows for start, rows, _, _ in segments)
    x, y0 = torch.randn(m, 576, generator=gen), torch.randn(m, 960, generator=gen)
    outs = outputs_on_1_and_2_threads(kernels, x, y0, a, bt, segments)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), _reference(x, y0, a, bt, segments), rtol=1e-5, atol=1e-5)


def outputs_on_1_and_2_threads(kernels: CpuKernels, x: torch.Tensor, y0: torch.Tensor, a: torch.Tensor,
                               bt: torch.Tensor, segments: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
    """The kernel's y on 1 thread, then on 2 (from the same y0)."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(kernels.lora_add_(x, y0.clone(), a, bt, _table(segments)))
    finally:
        torch.set_num_threads(threads)
    return outs


# rank 256 and 512 adapters of a fused q/k/v projection (768 and 1536 columns), of gate/up (1024), one at rank 8
# in a slot of rank 256 (24 of 768 columns), a prefill run of 37 rows (items of 16) and decode rows; out = 37
# leaves a tail of y's columns past the last vector on every ISA
WIDE = [(0, 37, 0, 1536), (37, 1, 1, 768), (38, 3, 2, 1024), (41, 2, 3, 24), (43, 4, 0, 1000), (47, 1, 2, 512),
        (48, 5, 1, 513)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_512_fused_slots_equal_their_512_column_chunks_added_in_turn(
    builds: dict[str, CpuKernels], dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    a, bt = _adapters(4, 1536, 48, 37, [1536, 768, 1024, 24], gen)
    a, bt = a.to(dtype), bt.to(dtype)
    x, y0 = torch.randn(53, 48, generator=gen), torch.randn(53, 37, generator=gen)
    ref = _reference(x, y0, a.float(), bt.float(), WIDE)
    for level, kernels in builds.items():
        y = kernels.lora_add_(x, y0.clone(), a, bt, _table(WIDE))
        chunked = y0.clone()
        for c0 in range(0, 1536, 512):  # the same sums, one call per 512 columns
            part = [(s, r, slot, min(max(cols - c0, 0), 512)) for s, r, slot, cols in WIDE]
            kernels.lora_add_(x, chunked, a[:, c0 : c0 + 512].contiguous(), bt[:, c0 : c0 + 512].contiguous(),
                              _table(part))
        assert torch.equal(y, chunked), level
        if dtype == torch.float32:  # bfloat16 products round x and x A^T: compared with their chunks only
            torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-3, msg=level)
        assert not torch.equal(y, y0), level


def test_rank_512_fused_slots_do_not_depend_on_the_thread_count(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(4)
    a, bt = _adapters(4, 1536, 96, 75, [1536, 768, 1024, 24], gen)
    x, y0 = torch.randn(53, 96, generator=gen), torch.randn(53, 75, generator=gen)
    outs = outputs_on_1_and_2_threads(kernels, x, y0, a, bt, WIDE)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), _reference(x, y0, a, bt, WIDE), rtol=1e-4, atol=1e-3)


def test_no_segments_and_no_rows(kernels: CpuKernels) -> None:
    a, bt = torch.randn(2, 8, 16), torch.randn(2, 8, 8)
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    before = y.clone()
    kernels.lora_add_(x, y, a, bt, torch.zeros(0, 4, dtype=torch.int32))
    kernels.lora_add_(x, y, a, bt, _table([(4, 0, 1, 8), (0, 4, 0, 0)]))
    kernels.lora_add_(torch.zeros(0, 16), torch.zeros(0, 8), a, bt, _table([(0, 0, 1, 8)]))
    assert torch.equal(y, before)


def _bad_calls() -> list[tuple[str, dict[str, object], str]]:
    x, y, a, bt = torch.randn(8, 16), torch.randn(8, 12), torch.randn(3, 4, 16), torch.randn(3, 4, 12)
    ok = _table([(0, 4, 1, 4)])
    return [
        ("x float64", {"x": x.double()}, "x must be a float32"),
        ("x columns strided", {"x": torch.randn(16, 8).t()}, "x must be a float32"),
        ("y rows", {"y": torch.randn(7, 12)}, "must be"),
        ("a width", {"a": torch.randn(3, 4, 15)}, "a must be"),
        ("bt slots", {"bt": torch.randn(2, 4, 12)}, "bt must be"),
        ("bt not contiguous", {"bt": torch.randn(3, 12, 4).transpose(1, 2)}, "bt must be"),
        ("cmax over 1536", {"a": torch.zeros(1, 1537, 16), "bt": torch.zeros(1, 1537, 12)}, "at most 1536"),
        ("segments int64", {"segments": ok.long()}, "int32"),
        ("segments shape", {"segments": torch.zeros(2, 3, dtype=torch.int32)}, "int32"),
        ("negative", {"segments": _table([(0, -1, 0, 4)])}, "negative"),
        ("past the rows", {"segments": _table([(6, 3, 0, 4)])}, "row 9"),
        ("no such slot", {"segments": _table([(0, 2, 3, 4)])}, "slot 3"),
        ("cols over cmax", {"segments": _table([(0, 2, 0, 5)])}, "5 columns"),
        ("overlap", {"segments": _table([(4, 4, 0, 4), (0, 5, 1, 4)])}, "overlap"),
    ] + [("ok", {"x": x, "y": y, "a": a, "bt": bt, "segments": ok}, "")]


@pytest.mark.parametrize("case", [c for c in _bad_calls() if c[0] != "ok"], ids=lambda c: c[0])
def test_bad_arguments_are_value_errors(kernels: CpuKernels, case: tuple[str, dict[str, object], str]) -> None:
    args = dict(next(c for c in _bad_calls() if c[0] == "ok")[1])
    y_before = args["y"].clone()  # type: ignore[union-attr]
    args.update(case[1])
    with pytest.raises(ValueError, match=case[2]):
        kernels.lora_add_(**args)  # type: ignore[arg-type]
    if "y" not in case[1]:
        assert torch.equal(args["y"], y_before)  # nothing written


def test_the_c_entry_point_checks_what_it_can(kernels: CpuKernels) -> None:
    """Straight through ctypes: bad sizes are CB_EINVAL, bad or overlapping segments CB_ERANGE."""
    x, y, a, bt = torch.randn(8, 16), torch.zeros(8, 12), torch.randn(2, 4, 16), torch.randn(2, 4, 12)
    fn = kernels._lib.cb_lora_add_f32

    def call(seg: list[tuple[int, int, int, int]], cmax: int = 4, ldx: int = 16) -> int:
        table = _table(seg)
        return fn(x.data_ptr(), ldx, y.data_ptr(), 12, 16, 12, a.data_ptr(), bt.data_ptr(), cmax,
                  ctypes.c_void_p(table.data_ptr()), table.shape[0])

    codes = abi.RETURN_CODES
    assert call([(0, 8, 1, 4)]) == codes["CB_OK"]
    assert call([(0, 8, 1, 4)], ldx=15) == call([(0, 8, 1, 4)], cmax=1537) == codes["CB_EINVAL"]
    assert call([(0, 2, 0, 5)]) == call([(0, -2, 0, 4)]) == call([(2, 3, 0, 4), (4, 1, 1, 1)]) == codes["CB_ERANGE"]
    torch.testing.assert_close(y, (x @ a[1].t()) @ bt[1])
