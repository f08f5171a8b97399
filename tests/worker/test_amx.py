"""bfloat16 products on Intel AMX tiles (``csrc/amx.c``): where the CPU has AMX, ``cb_linear`` multiplies blocks
of 4 rows or more of the bfloat16-products formats on tiles, the operands rounded as the AVX-512 BF16 path
rounds them and the products summed in float32 in another order.

Checked on an AMX machine: the tile path against a float64 product of the same rounded operands for every
format and shape class (a partial last panel, rows not a multiple of 16, more than one 192-row item, bias),
that it is the path taken (its sums differ from the AVX-512 path's in the last bits), that it does not depend
on the thread count, and that the shapes it leaves (fewer than 4 rows, k not a multiple of 32) give the
AVX-512 path's bits. On any machine: ``set_amx`` reports AMX exactly where the CPU has it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.gguf_blocks import QuantBlocks
from cbserve.worker.cpu.kernels import CpuKernels, Panels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


def _cpu_has_amx() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " amx_bf16" in cpuinfo.read_text()


HAS_AMX = _cpu_has_amx()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="no AMX on this CPU")


@pytest.fixture
def amx(kernels: CpuKernels) -> Iterator[CpuKernels]:
    """The kernels with AMX on again after the test, whatever it switched."""
    yield kernels
    kernels.set_amx(True)


def _packed(kernels: CpuKernels, fmt: str, w: torch.Tensor) -> tuple[Panels, torch.Tensor]:
    """``w`` packed as ``fmt`` for bfloat16 products, and the float32 weight the kernel multiplies by."""
    if fmt == "bf16_dot":
        packed = kernels.pack_weight(w, "bf16_dot")
    else:
        raw = quantize(w.numpy(), GGMLQuantizationType[fmt])
        blocks = QuantBlocks(fmt, torch.from_numpy(raw))
        packed = kernels.pack_blocks(blocks)
        packed = kernels.with_bf16_products(packed)
    return packed, kernels.unpack(packed)


def test_set_amx_reports_amx_where_the_cpu_has_it(amx: CpuKernels) -> None:
    assert amx.set_amx(True) is HAS_AMX
    assert amx.set_amx(False) is False


@needs_amx
@pytest.mark.parametrize("fmt", ["bf16_dot", "Q8_0", "Q4_1"])
@pytest.mark.parametrize(("m", "n", "k"), [(4, 48, 32), (5, 100, 64), (17, 150, 576), (63, 49, 320),
                                           (200, 97, 128), (400, 50, 288)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_the_product_of_rounded_operands(
    amx: CpuKernels, fmt: str, m: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    x, bias = torch.randn(m, k, generator=gen), (torch.randn(n, generator=gen) if with_bias else None)
    packed, dense = _packed(amx, fmt, w)
    assert amx.set_amx(True)
    out = amx.linear(x, packed, bias)
    ref = x.bfloat16().double() @ dense.double().T + (bias.double() if bias is not None else 0)
    scale = x.bfloat16().double().abs() @ dense.double().abs().T
    assert ((out.double() - ref).abs() <= 1e-6 * scale + 1e-6).all()


@needs_amx
def test_amx_is_the_path_taken_and_does_not_depend_on_threads(amx: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(11)
    w, x, bias = torch.randn(150, 576, generator=gen) * 0.05, torch.randn(64, 576, generator=gen), torch.randn(150)
    packed, _ = _packed(amx, "Q4_1", w)
    assert amx.set_amx(True)
    tiles = amx.linear(x, packed, bias)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx.linear(x, packed, bias), tiles)
    finally:
        torch.set_num_threads(threads)
    assert not amx.set_amx(False)
    avx512 = amx.linear(x, packed, bias)
    assert torch.allclose(tiles, avx512, rtol=1e-5, atol=1e-5)
    assert not torch.equal(tiles, avx512)  # other sums: the tiles did the work


@needs_amx
@pytest.mark.parametrize(("m", "k"), [(1, 576), (3, 576), (40, 330), (40, 48)])
def test_shapes_amx_leaves_get_the_avx512_bits(amx: CpuKernels, m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m + k)
    w, x = torch.randn(70, k, generator=gen), torch.randn(m, k, generator=gen)
    packed = amx.pack_weight(w, "bf16_dot")
    assert amx.set_amx(True)
    with_amx = amx.linear(x, packed, None)
    amx.set_amx(False)
    assert torch.equal(with_amx, amx.linear(x, packed, None))


@needs_amx
def test_amx_reads_strided_rows(amx: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(40, 100, generator=gen)
    x = big[:, 3:67]  # 64 columns, rows 100 floats apart
    packed = amx.pack_weight(0.1 * torch.randn(60, 64, generator=gen), "bf16_dot")
    assert amx.set_amx(True)
    assert torch.equal(amx.linear(x, packed, None), amx.linear(x.contiguous(), packed, None))
