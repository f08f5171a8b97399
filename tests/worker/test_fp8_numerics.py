"""FP8 numerics (``quantization="fp8"``): the row quantizer every FP8 path shares (worker/fp8.py), the FP8 linear
weight against its reference (layers/fp8_linear.py), the per-token Triton quantizer against torch's
(cuda/fp8_quant.py, interpreted without a GPU), and the device check."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn
from worker_testlib import interpreted_triton

from cbserve.worker.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, check_fp8_device, dequantize_rows, quantize_rows
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear
from cbserve.worker.layers.fp8_linear import Fp8Weight, quantize_linear_weights
from cbserve.worker.layers.moe import SparseMoeBlock

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
E4M3_STEP = 2.0**-3  # relative spacing of e4m3's normal values (3 mantissa bits): rounding errs by at most half


def _rows(gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes, one with an outlier far beyond 448; one so small that the scale's floor
    holds (its largest value maps below 448), one all zeros."""
    x = torch.randn(6, 96, generator=gen) * torch.tensor([1e-2, 1.0, 30.0, 1e4, 1e-4, 1.0])[:, None]
    x[5] = 0.0
    x[1, 7] = 5000.0
    return x


def test_quantize_rows_maps_each_rows_largest_value_to_448() -> None:
    x = _rows(torch.Generator().manual_seed(0))
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scale[:4], amax[:4] / FP8_MAX)
    assert torch.equal(q[:4].float().abs().amax(-1), torch.full((4,), FP8_MAX))
    assert scale[4].item() == scale[5].item() == pytest.approx(MIN_SCALE) and q[4].float().abs().max() < FP8_MAX
    assert torch.equal(dequantize_rows(q, scale)[5], x[5])
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all()
    # normal values within half a step, relative; subnormal ones (below 2^-6 of the scale) within half of 2^-9
    err = (back - x).abs()
    assert bool((err <= torch.maximum(x.abs() * E4M3_STEP / 2, scale * 2.0**-10) * (1 + 1e-6)).all())
    assert (back != x).any()  # it rounds


def test_quantize_rows_rounds_ties_to_even_as_the_cast() -> None:
    """Values halfway between two e4m3 values, scaled by 1: the nearer even one (torch's cast)."""
    x = torch.tensor([[448.0, 1.0 + 2**-4, 1.0 + 3 * 2**-4, 2**-9 + 2**-10, 0.0]])
    q, scale = quantize_rows(x)
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 2**-8, 0.0]]


def test_fp8_weight_matches_its_reference_and_is_quantized() -> None:
    """The emulated product equals the one on dequantized operands (what ``_scaled_mm`` computes: exact e4m3
    products, float32 sums, both scales) and differs from the unquantized product by e4m3's rounding only."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=gen) * torch.rand(48, 1, generator=gen) * 4  # rows of different scales
    x = torch.randn(5, 64, generator=gen) * 3
    bias = torch.randn(48, generator=gen)
    fw = Fp8Weight.quantize(w)
    assert fw.weight.dtype == FP8_DTYPE and fw.scale.shape == (1, 48) and fw.dtype == torch.float32
    xq, xs = quantize_rows(x)
    ref = (xq.double() * xs.double()) @ fw.dequantize().double().t() + bias.double()
    y = fw.matmul(x, bias)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + bias
    rel = ((y - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.05


def test_fp8_weight_keeps_the_activation_dtype() -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(32, 16, generator=gen).bfloat16()
    fw = Fp8Weight.quantize(w)
    x = torch.randn(3, 16, generator=gen).bfloat16()
    y = fw.matmul(x, None)
    assert y.dtype == torch.bfloat16 and fw.dtype == torch.bfloat16
    exact = x.float() @ w.float().t()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 0.08


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(32, [16, 16], bias=True)
        self.down = RowParallelLinear(32, 32, bias=False)
        for p in self.parameters():
            nn.init.normal_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def test_quantize_linear_weights_swaps_every_linear_layer() -> None:
    torch.manual_seed(3)
    model = _TwoLayers()
    x = torch.randn(4, 32)
    with torch.no_grad():
        dense = model(x)
        assert quantize_linear_weights(model) == 2
        quantized = model(x)
    for layer in (model.up, model.down):
        assert isinstance(layer.packed, Fp8Weight) and layer.weight.numel() == 0
    assert model.up.bias is not None and model.up.bias.numel() == 32  # biases stay
    rel = ((quantized - dense).norm() / dense.norm()).item()
    assert 1e-4 < rel < 0.08


def test_mixture_of_experts_models_are_refused() -> None:
    model = _TwoLayers()
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    nn.Module.__init__(block)
    model.moe = block
    with pytest.raises(ValueError, match="mixture-of-experts"):
        quantize_linear_weights(model)
    assert model.up.packed is None  # nothing half done


@pytest.fixture(scope="module")
def fq() -> ModuleType:
    pytest.importorskip("triton")
    from cbserve.worker.attention import triton_jit
    from cbserve.worker.cuda import fp8_quant

    if not CUDA:
        interpreted_triton(triton_jit, fp8_quant, probe="_per_token_quant_kernel")
    return fp8_quant


@pytest.mark.cuda
@pytest.mark.parametrize("cols", [96, 5000])  # one tile; several tiles with a masked tail
def test_per_token_kernel_matches_quantize_rows(fq: ModuleType, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(4, cols, generator=gen) * torch.tensor([1e-3, 1.0, 300.0, 0.0])[:, None]
    x[1, 11] = 1e4
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        q, scale = fq.quantize_tokens(xd.to(DEVICE))
        q_ref, scale_ref = quantize_rows(xd)
        torch.testing.assert_close(scale.cpu(), scale_ref, rtol=1e-6, atol=0)
        # the compiled kernel's division may round one value to the neighbouring e4m3 value; interpreted: exact
        torch.testing.assert_close(q.cpu().float(), q_ref.float(), rtol=0.0625 if CUDA else 0, atol=0)
    assert fq.quantize_tokens(torch.zeros(0, 16, device=DEVICE))[0].shape == (0, 16)
    with pytest.raises(ValueError, match="2-D"):
        fq.quantize_tokens(torch.zeros(2, 3, 4, device=DEVICE))


def test_device_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU emulates (no error); a CUDA device below compute capability 8.9 is refused, naming the setting and
    the card."""
    check_fp8_device(torch.device("cpu"), "quantization='fp8'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8': FP8 needs a GPU of compute capability 8.9.*A100.*8.0"):
        check_fp8_device(torch.device("cuda", 0), "kv_cache_dtype='fp8'")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0), "quantization='fp8'")


_SCRIPT = r"""
from cbserve.worker.cuda import fp8_quant
for dtype, cols in json.loads(sys.argv[1]):
    block = min(fp8_quant.MAX_BLOCK, triton.next_power_of_2(cols))
    types = dict(x_ptr=dtype, q_ptr="*fp8e4nv", scale_ptr="*fp32", n_cols="i32", stride_x="i32", stride_q="i32")
    k, usage = build(fp8_quant._per_token_quant_kernel, types, dict(BLOCK=block),
                     {"num_warps": 4 if block <= 1024 else 8})
    print("COMPILED", dtype, cols, usage)
"""


@pytest.mark.slow
def test_per_token_kernel_compiles_for_sm90() -> None:
    """The quantizer compiles to an sm_90 cubin for the launcher's tiles (SmolLM2's 576 columns, Llama-3-8B's 4096
    and 14336), without spilling to local memory."""
    from sm90_compile_lib import assert_sm90_builds_fit

    cases = [["*bf16", 576], ["*bf16", 4096], ["*bf16", 14336], ["*fp16", 4096]]
    assert len(assert_sm90_builds_fit(_SCRIPT, cases)) == 4


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm needs a CUDA GPU (compute capability 8.9+)")
def test_scaled_mm_on_the_gpu_matches_the_emulation() -> None:
    """The CUDA path (Triton per-token quantization, ``torch._scaled_mm`` with row-wise scales, bfloat16 out) against
    the CPU emulation of the same weight: equal up to bfloat16's rounding of the output."""
    from cbserve.worker.layers.fp8_linear import probe_scaled_mm

    probe_scaled_mm(torch.device("cuda"))
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(256, 512, generator=gen) * 0.05).bfloat16()
    x = torch.randn(33, 512, generator=gen).bfloat16()
    bias = torch.randn(256, generator=gen).bfloat16()
    emulated = Fp8Weight.quantize(w).matmul(x, bias)
    gpu = Fp8Weight.quantize(w.cuda()).matmul(x.cuda(), bias.cuda())
    assert gpu.dtype == torch.bfloat16
    torch.testing.assert_close(gpu.cpu().float(), emulated.float(), rtol=2e-2, atol=2e-2)
