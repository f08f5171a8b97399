"""The few-row products (csrc/rows.c): a decode step's 1-4 rows multiply the packed weights decoded in
registers instead of through the tiled path's float32 scratch. They must give what the tiled path gives the same
rows inside a larger batch, bit for bit, at every ISA level this CPU runs and in every float32-products format:
each output is the same k-order sum of the same float32 weights (the GGUF blocks included). The shapes cross a
partial last panel, several GGUF blocks and rows read with a stride."""

from __future__ import annotations

import pytest
import torch
from test_isa_levels import LEVELS, _weights

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

N, K = 150, 576  # three full panels and a partial one; 18 GGUF blocks


@pytest.fixture(scope="module", params=LEVELS)
def level_kernels(request: pytest.FixtureRequest) -> CpuKernels:
    load = cpu_native.load_cpu_kernels(request.param)
    assert load.kernels is not None, load.reason
    return load.kernels


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_1", "q4_0"])
def test_few_rows_equal_the_same_rows_in_a_batch_bit_for_bit(level_kernels: CpuKernels, fmt: str) -> None:
    gen = torch.Generator().manual_seed(len(fmt))
    panels = _weights(level_kernels, fmt, N, K, gen)[0]
    wide = torch.randn(9, K + 40, generator=gen)
    x, bias = wide[:, 20:20 + K], torch.randn(N, generator=gen)  # rows K + 40 floats apart
    for b in (None, bias):
        batch = level_kernels.linear(x, panels, b)  # nine rows: the tiled path
        for m in (1, 2, 3, 4):
            for start in (0, 9 - m):
                got = level_kernels.linear(x[start:start + m], panels, b)
                assert torch.equal(got, batch[start:start + m]), (fmt, m, start, b is not None)
                assert level_kernels.set_rows(False)  # the same rows with the few-row path switched off
                try:
                    assert torch.equal(level_kernels.linear(x[start:start + m], panels, b), got)
                finally:
                    level_kernels.set_rows(True)
