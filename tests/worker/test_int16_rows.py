"""The int16-rows variants of the 4-8-bit block formats (csrc/rows_i16.c, ``CpuKernels.with_int16_rows``): a decode
step's few rows are rounded to int16 per block of 32 values and multiplied in integer pairs. At every ISA level this
CPU runs and in every such format, each output must be within the rounding's bound of the float32 product:
sum over blocks of (the block's scale / 2) times the block's absolute weights, the scale being max|x| / 32767 of the
block (plus float32 rounding). More rows than the few-row path takes, and the other formats, keep the float32
products bit for bit: the tiled path reads the int16-pairs layout (csrc/i16.h) back to the format's float32
weights."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_isa_levels import LEVELS, _weights

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.abi import INT16_ROWS_FORMATS, format_code
from cbserve.worker.cpu.kernels import CpuKernels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

N, K = 150, 768  # three full panels and a partial one; three K-quant super-blocks, 24 blocks of 32


@pytest.fixture(scope="module", params=LEVELS)
def level_kernels(request: pytest.FixtureRequest) -> CpuKernels:
    load = cpu_native.load_cpu_kernels(request.param)
    assert load.kernels is not None, load.reason
    return load.kernels


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[m, n]: how far int16 rows may move each output: per block of 32, half the block's step times its weights'
    absolute sum, plus float32 rounding of the whole product."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    step = xb.abs().amax(dim=2) / 32767  # [m, blocks]
    wabs = w.double().abs().reshape(w.shape[0], -1, 32).sum(dim=2)  # [n, blocks]
    return step / 2 @ wabs.T * 1.001 + 1e-5 * (x.double().abs() @ w.double().abs().T)


def rows(gen: torch.Generator) -> torch.Tensor:
    """Nine rows K + 40 floats apart: blocks at very different scales, one block all zero."""
    wide = torch.randn(9, K + 40, generator=gen)
    x = wide[:, 20 : 20 + K]
    x[:, :32] *= 1e3
    x[:, 64:96] *= 1e-3
    x[:, 128:160] = 0
    return x


@pytest.mark.parametrize("fmt", INT16_ROWS_FORMATS)
def test_int16_rows_stay_within_the_rounding_bound_of_the_float32_product(level_kernels: CpuKernels,
                                                                           fmt: str) -> None:
    gen = torch.Generator().manual_seed(len(fmt) + ord(fmt[-1]))
    panels = _weights(level_kernels, fmt, N, K, gen)[0]
    fast = level_kernels.with_int16_rows(panels)
    w, x, bias = level_kernels.unpack(panels), rows(gen), torch.randn(N, generator=gen)
    assert torch.equal(level_kernels.unpack(fast), w)  # the same bytes, the same weights
    for b in (None, bias):
        exact = level_kernels.linear(x, panels, b)  # nine rows: the tiled path, float32
        assert torch.equal(level_kernels.linear(x, fast, b), exact)  # many rows: float32 products still
        for m in (1, 2, 3, 4):
            got, want = level_kernels.linear(x[:m], fast, b), exact[:m]
            bound = rounding_bound(x[:m], w)
            assert bool(((got.double() - want.double()).abs() <= bound).all()), (fmt, m, b is not None)
        one = level_kernels.linear(x[:1], fast, b)
        assert not torch.equal(one, exact[:1])  # one row did take the int16 path
        assert float((one - exact[:1]).abs().max()) < 1e-3 * float(exact[:1].abs().max())



@pytest.mark.parametrize("fmt", INT16_ROWS_FORMATS)
def test_every_row_variant_rounds_many_rows_too_within_the_bound(level_kernels: CpuKernels, fmt: str) -> None:
    """``with_int16_rows(every_row=True)`` ("<fmt>_i16all", cpu_prefill_activations "int16"): the same bytes as the
    int16-rows variant; a few rows give its products bit for bit. In a build with int16 multiply-adds in one
    instruction ("i16_dot"), any number of rows (a prefill's, in tiles of a few: two tiles and a part for nine rows)
    is rounded to int16 and stays within the bound of the float32 product, each row's result the same wherever its
    tile falls; in a build without, more rows keep the float32 products bit for bit."""
    gen = torch.Generator().manual_seed(3 * len(fmt) + ord(fmt[-1]))
    panels = _weights(level_kernels, fmt, N, K, gen)[0]
    rows16, every = level_kernels.with_int16_rows(panels), level_kernels.with_int16_rows(panels, every_row=True)
    assert every.fmt == f"{fmt}_i16all" and torch.equal(every.data, rows16.data)
    w, x, bias = level_kernels.unpack(panels), rows(gen), torch.randn(N, generator=gen)
    tiles = "i16_dot" in level_kernels.isa_features
    for b in (None, bias):
        exact = level_kernels.linear(x, panels, b)
        assert torch.equal(level_kernels.linear(x[:2], every, b), level_kernels.linear(x[:2], rows16, b))
        for m in (5, 9):
            got = level_kernels.linear(x[:m], every, b)
            if not tiles:
                assert torch.equal(got, exact[:m])
                continue
            bound = rounding_bound(x[:m], w)
            assert bool(((got.double() - exact[:m].double()).abs() <= bound).all()), (fmt, m, b is not None)
            assert not torch.equal(got, exact[:m])  # rounded, not the float32 products
        big = torch.cat([x] * 7)  # 63 rows: every tile of every panel
        assert torch.equal(level_kernels.linear(big, every, b)[-9:], level_kernels.linear(x, every, b))


def test_only_the_block_formats_of_4_to_8_bits_have_int16_rows(level_kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(7)
    for fmt in ("f32", "bf16"):
        with pytest.raises(ValueError, match="int16-rows variant"):
            level_kernels.with_int16_rows(_weights(level_kernels, fmt, 48, 64, gen)[0])
    assert format_code("q4_k_i16") == format_code("q4_k") | 256
    assert format_code("q8_0_i16all") == format_code("q8_0") | 768
    with pytest.raises(KeyError):
        format_code("bf16_i16")


@pytest.mark.parametrize("fmt", INT16_ROWS_FORMATS)
def test_the_tiled_path_on_int16_panels_gives_the_plain_formats_float32_products(level_kernels: CpuKernels,
                                                                               fmt: str) -> None:
    gen = torch.Generator().manual_seed(3 * len(fmt) + ord(fmt[1]))
    panels = _weights(level_kernels, fmt, N, K, gen)[0]
    fast = level_kernels.with_int16_rows(panels)
    x, bias = torch.randn(65, K, generator=gen), torch.randn(N, generator=gen)
    for m in (5, 8, 32, 65):  # past the few-row path: the tiled one, its few- and many-row chunks
        assert torch.equal(level_kernels.linear(x[:m], fast, bias), level_kernels.linear(x[:m], panels, bias)), m
    before = level_kernels.set_rows(False)  # 1-4 rows on the tiled path too
    try:
        for m in (1, 2, 4):
            assert torch.equal(level_kernels.linear(x[:m], fast, None), level_kernels.linear(x[:m], panels, None)), m
    finally:
        level_kernels.set_rows(before)


def _values_from_int16_layout(fmt: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[n, k] values (0..15, 31 or 63) read from an int16-pairs panel by the layout's definition (csrc/i16.h)."""
    dwords = lambda raw, rows: raw.view(np.uint32).reshape(rows, 48).astype(np.int64)  # noqa: E731
    block, q_at, qh_at = {"q4_0": (864, 96, None), "q5_0": (1056, 96, 864), "q6_k": (1248, 96, 864)}[fmt]
    head, raw = (96 if fmt == "q6_k" else 0), data.numpy()  # Q6_K: a float16 d[48] before each 8 blocks
    per_panel = (k // 256) * (head + 8 * block) if fmt == "q6_k" else (k // 32) * block
    out = np.zeros((-(-n // 48) * 48, k), dtype=np.int64)
    for p in range(-(-n // 48)):
        for b in range(k // 32):
            at = p * per_panel + (b // 8 * (head + 8 * block) + head + b % 8 * block if head else b * block)
            q = dwords(raw[at + q_at : at + q_at + 768], 4)  # [g][column]
            vals = out[48 * p : 48 * p + 48, 32 * b : 32 * b + 32]
            for g in range(4):
                for pair in range(4):
                    vals[:, 8 * g + 2 * pair] = (q[g] >> 4 * pair) & 15
                    vals[:, 8 * g + 2 * pair + 1] = (q[g] >> (16 + 4 * pair)) & 15
            if fmt == "q5_0":
                h = dwords(raw[at + qh_at : at + qh_at + 192], 1)[0]
                for m in range(16):
                    vals[:, 2 * m] |= ((h >> m) & 1) << 4
                    vals[:, 2 * m + 1] |= ((h >> (16 + m)) & 1) << 4
            elif fmt == "q6_k":
                h = dwords(raw[at + qh_at : at + qh_at + 384], 2)
                for t in range(16):
                    vals[:, 2 * t] |= ((h[t // 8] >> 2 * (t % 8)) & 3) << 4
                    vals[:, 2 * t + 1] |= ((h[t // 8] >> (16 + 2 * (t % 8))) & 3) << 4
    return torch.from_numpy(out[:n])


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q6_k"])
def test_repacking_regroups_the_values_as_the_layout_says(level_kernels: CpuKernels, fmt: str) -> None:
    gen = torch.Generator().manual_seed(11)
    n, top = 100, {"q4_0": 16, "q5_0": 32, "q6_k": 64}[fmt]
    q = torch.randint(0, top, (n, K), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, K // 32, generator=gen) * 0.01).half().float()
    if fmt == "q6_k":
        panels = level_kernels.pack_q6_k(d[:, : K // 256].contiguous(),
                                         torch.randint(-128, 128, (n, K // 16), dtype=torch.int8, generator=gen), q)
    else:
        panels = (level_kernels.pack_q4_0 if fmt == "q4_0" else level_kernels.pack_q5_0)(d, q)
    fast = level_kernels.with_int16_rows(panels)
    assert fast.data.numel() == panels.data.numel() and not torch.equal(fast.data, panels.data)
    assert torch.equal(_values_from_int16_layout(fmt, fast.data, n, K), q.long())
    assert torch.equal(level_kernels.unpack(fast), level_kernels.unpack(panels))
    in_place = panels.data.clone()  # the C repack also works in place, to the same bytes
    ptr = ctypes.c_void_p(in_place.data_ptr())
    assert level_kernels._lib.cb_repack_i16(format_code(fmt), ptr, n, K, ptr) == 0
    assert torch.equal(in_place, fast.data)
    x = torch.randn(4, K, generator=gen)
    for m in (1, 2, 3, 4):  # the few-row products of the repacked panel: within the bound of the float32 product
        got, want = level_kernels.linear(x[:m], fast, None), level_kernels.linear(x[:m], panels, None)
        assert bool(((got.double() - want.double()).abs() <= rounding_bound(x[:m], level_kernels.unpack(panels))).all())
