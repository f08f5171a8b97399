"""The linear kernels' work items are shared so that a preempted thread does not hold its partner up
(``cb_share_next`` in csrc/cb_simd.h: each thread takes items from the front of its own share, then the last
items of the others'). Whoever runs an item, the product must be the same bits, and no item may be skipped
or lost: checked against one thread for team sizes that do not divide the items, and for more threads than
this machine has cores (threads get preempted mid-region, so their partners take their items)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

TEAMS = (2, 3, 5, 8)
REPEATS = 6


@pytest.fixture
def threads() -> Iterator[None]:
    old = torch.get_num_threads()  # torch's OpenMP runtime is the one the kernels link (the same libgomp.so.1)
    yield
    torch.set_num_threads(old)


def one_thread(kernels: CpuKernels, x: torch.Tensor, packed: object, bias: torch.Tensor | None) -> torch.Tensor:
    torch.set_num_threads(1)
    return kernels.linear(x, packed, bias)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["f32", "bf16_dot"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1000, 96), (13, 1000, 130), (64, 500, 64), (200, 245, 40)])
def test_every_item_runs_once_whichever_thread_takes_it(
    kernels: CpuKernels, threads: None, fmt: str, m: int, n: int, k: int
) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    packed = kernels.pack_weight(w, fmt)
    ref = one_thread(kernels, x, packed, bias)
    assert torch.allclose(ref, x @ w.T + bias, rtol=0.02, atol=0.1)  # a product, not garbage (bf16 rounding)
    for team in TEAMS:
        torch.set_num_threads(team)
        for _ in range(REPEATS):
            out = kernels.linear(x, packed, bias)
            assert torch.equal(out, ref), f"{team} threads: {(out != ref).sum().item()} elements differ"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_one_row_over_gguf_blocks_is_shared_the_same_way(kernels: CpuKernels, threads: None, qtype: str) -> None:
    """The one-row path of GGUF blocks under bfloat16 products (a decode step with one request) shares its
    panels the same way."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from cbserve.worker.cpu.gguf_blocks import QuantBlocks

    w = np.random.default_rng(7).normal(0.0, 0.05, size=(1000, 256)).astype(np.float32)
    blocks = QuantBlocks(qtype, torch.from_numpy(quantize(w, GGMLQuantizationType[qtype])))
    raw = kernels.pack_blocks(blocks)
    packed = kernels.with_bf16_products(raw)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(7))
    ref = one_thread(kernels, x, packed, None)
    for team in TEAMS:
        torch.set_num_threads(team)
        for _ in range(REPEATS):
            assert torch.equal(kernels.linear(x, packed, None), ref), f"{team} threads"
