"""The int16-rows variants of the 4-6-bit block formats (csrc/rows_i16.c, ``CpuKernels.with_int16_rows``): a decode
step's few rows are rounded to int16 per block of 32 values and multiplied in integer pairs. At every ISA level this
CPU runs and in every such format, each output must be within the rounding's bound of the float32 product:
sum over blocks of (the block's scale / 2) times the block's absolute weights, the scale being max|x| / 32767 of the
block (plus float32 rounding). More rows than the few-row path takes, and the other formats, keep the float32
products bit for bit."""

from __future__ import annotations

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


def test_only_the_block_formats_of_4_to_6_bits_have_int16_rows(level_kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(7)
    for fmt in ("f32", "bf16", "q8_0"):
        with pytest.raises(ValueError, match="int16-rows variant"):
            level_kernels.with_int16_rows(_weights(level_kernels, fmt, 48, 64, gen)[0])
    assert format_code("q4_k_i16") == format_code("q4_k") | 256
    with pytest.raises(KeyError):
        format_code("q8_0_i16")
