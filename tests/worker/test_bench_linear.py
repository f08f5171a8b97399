"""benchmarks/bench_linear.py: it times the paths it names (AMX only where the CPU has it; the tiled path beside
the few-row one only where steps are few rows) on the products it says, over as many layers' weights as asked,
and restores the kernels' AMX and few-row switches."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.kernels import CpuKernels

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def bl(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/bench_linear.py, imported from its folder."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("bench_linear")


@pytest.mark.parametrize("fmt", ["Q4_1", "bf16"])
def test_packed_weights_multiply_as_the_shapes_say(bl: ModuleType, kernels: CpuKernels, fmt: str) -> None:
    weights = bl.packed_weights(kernels, fmt)
    assert set(weights) == set(bl.SHAPES)
    for name, (n, k) in bl.SHAPES.items():
        x = torch.randn(3, k)
        f32 = kernels.linear(x, weights[name]["f32"], None)
        bf16 = kernels.linear(x, weights[name]["bf16"], None)
        assert f32.shape == bf16.shape == (3, n)
        assert not torch.equal(f32, bf16)  # other products: bfloat16 operands
        torch.testing.assert_close(bf16, f32, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("layers", [1, 2])
def test_measure_reports_each_path_and_restores_the_switches(
    bl: ModuleType, kernels: CpuKernels, capsys: pytest.CaptureFixture, layers: int
) -> None:
    has_amx = kernels.set_amx(True)
    rows = bl.measure(kernels, "Q4_1", [1, 16], repeats=1, peak_gflops=100.0, roofline_ms=0.5, layers=layers)
    bf16 = "bf16 avx512" if "avx512_bf16" in kernels.isa_features else "bf16 fma"
    torch_paths = list(bl.torch_products(kernels, [bl.packed_weights(kernels, "Q4_1")]))
    assert torch_paths[0] == "torch F.linear"
    paths = ["f32", "f32 tiled", bf16, *(["bf16 amx"] if has_amx else []), *torch_paths]
    assert [(r["rows"], r["path"]) for r in rows] == [(m, p) for m in (1, 16) for p in paths
                                                     if m == 1 or p != "f32 tiled"]
    for r in rows:
        assert r["ms"] > 0 and r["gflops"] == pytest.approx(bl.layer_flops(r["rows"]) / (r["ms"] / 1e3) / 1e9)
        assert ("of_peak" in r) is (r["path"] == "f32")
        assert ("of_roofline" in r) is (r["path"] == "f32" and r["rows"] == 1)
    assert [r["vs_f32"] for r in rows if r["path"] == "f32"] == [1.0, 1.0]
    assert kernels.set_amx(True) is has_amx  # the switch is back on where AMX exists
    assert kernels.set_rows(True) is True  # the few-row path is back on
    assert len(capsys.readouterr().out.strip().splitlines()) == len(rows)


def test_torch_products_are_the_same_weights(bl: ModuleType, kernels: CpuKernels) -> None:
    weights = bl.packed_weights(kernels, "Q4_1")
    x = torch.randn(5, bl.SHAPES["o"][1])
    ours = kernels.linear(x, weights["o"]["f32"], None)
    for name, product in bl.torch_products(kernels, [weights]).items():
        torch.testing.assert_close(product(0, "o", x), ours, atol=1e-4, rtol=1e-4, msg=name)
