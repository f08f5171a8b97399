"""cbserve's C kernels for CPU (csrc/gemm.c, csrc/elementwise.c) against torch, the choice of cpu_ops, and a
whole model on them against the plain-torch model. Greedy equality with HF on these kernels is covered by
test_model_equivalence.py and test_gguf_smollm2.py, which run with the default cpu_ops="auto"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from worker_testlib import make_tiny_model

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu import ops as cpu_ops
from cbserve.worker.cpu.kernels import CpuKernels, Panels
from cbserve.worker.cpu.native import KernelLoad
from cbserve.worker.layers.rotary import apply_rotary
from cbserve.worker.runner.input_batch import CachedRequestState, build_batch
from cbserve.worker.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("m", [0, 1, 3, 8, 11, 17, 64, 200])
@pytest.mark.parametrize("n,k", [(48, 16), (100, 37), (960, 576), (7, 130)])
def test_linear_matches_f_linear(kernels: CpuKernels, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(m, k, generator=gen)
    packed = kernels.pack_weight(w)
    assert packed.fmt == "f32" and (packed.n, packed.k) == (n, k)
    assert packed.nbytes == -(-n // kernels.panel_width) * kernels.panel_width * k * 4
    assert torch.equal(kernels.unpack(packed), w)
    tol = 2e-6 * k
    torch.testing.assert_close(kernels.linear(x, packed, b), F.linear(x, w, b), atol=tol, rtol=1e-5)
    torch.testing.assert_close(kernels.linear(x, packed, None), F.linear(x, w), atol=tol, rtol=1e-5)


def test_linear_reads_strided_rows_and_is_thread_count_independent(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    big_w = torch.randn(150, 300, generator=gen)
    w = big_w[:, 10:202]  # rows 300 floats apart
    x = torch.randn(40, 500, generator=gen)[:, 7:199]  # likewise for the input
    packed = kernels.pack_weight(w)
    torch.testing.assert_close(kernels.linear(x, packed, None), x @ w.t(), atol=1e-3, rtol=1e-5)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, packed, None)
        torch.set_num_threads(2)
        two = kernels.linear(x, packed, None)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)  # each output is one thread's dot product in k order


def test_linear_refuses_what_does_not_fit(kernels: CpuKernels) -> None:
    w = torch.randn(10, 8)
    packed = kernels.pack_weight(w)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.linear(torch.randn(2, 9), packed, None)  # k mismatch
    with pytest.raises(ValueError, match="float32"):
        kernels.linear(torch.randn(2, 8).double(), packed, None)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.linear(torch.randn(8, 2).t(), packed, None)
    with pytest.raises(ValueError, match="vector of 10"):
        kernels.linear(torch.randn(2, 8), packed, torch.randn(9))
    with pytest.raises(ValueError, match="float32"):
        kernels.pack_weight(w.half())
    with pytest.raises(ValueError, match="does not fit"):  # bytes that are not this packing
        kernels.linear(torch.randn(2, 8), Panels("f32", packed.data[:-4], 10, 8), None)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.linear(torch.randn(2, 8), Panels("q4_1", packed.data, 10, 8), None)


@pytest.mark.parametrize("m,h", [(1, 576), (7, 64), (300, 200)])
def test_add_rms_norm(kernels: CpuKernels, m: int, h: int) -> None:
    gen = torch.Generator().manual_seed(m + h)
    x, r, w = torch.randn(m, h, generator=gen), torch.randn(m, h, generator=gen), torch.randn(h, generator=gen)
    expected_sum = x + r
    out, res = kernels.add_rms_norm(x, r, w, 1e-5)
    assert res is r and torch.equal(r, expected_sum)  # the sum replaces the residual, exactly as x + r
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (h,), w, 1e-5), atol=1e-5, rtol=1e-5)
    out2, res2 = kernels.add_rms_norm(x, None, w, 1e-6)
    assert res2 is x
    torch.testing.assert_close(out2, F.rms_norm(x, (h,), w, 1e-6), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        kernels.add_rms_norm(x, r[:, :-1], w, 1e-5)


def test_silu_and_mul_including_extreme_inputs(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * 300, generator=gen) * 4
    x[0, :6] = torch.tensor([-200.0, -88.0, -30.0, 30.0, 88.0, 200.0])  # exp over/underflow territory
    gate, up = x.chunk(2, dim=-1)
    got = kernels.silu_and_mul(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="even number"):
        kernels.silu_and_mul(torch.randn(2, 5))


def test_rotary_in_place_matches_torch(kernels: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    d, max_pos = 64, 50
    freqs = torch.rand(max_pos, d // 2, generator=gen) * 10
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = torch.randn(6, 9 * d, generator=gen)  # 6 rotated heads, then 3 that stay as they are
    pos = torch.tensor([0, 5, 49, 3, 3, 7])
    before = qkv.clone()
    expected = apply_rotary(before[:, : 6 * d].view(6, 6, d), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    kernels.rotary_(qkv[:, : 6 * d], d, pos, cos, sin)
    torch.testing.assert_close(qkv[:, : 6 * d].view(6, 6, d), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 6 * d :], before[:, 6 * d :])
    with pytest.raises(RuntimeError, match="outside its table"):
        kernels.rotary_(qkv[:, : 6 * d], d, torch.tensor([0, 1, 2, 3, 4, 50]), cos, sin)
    with pytest.raises(ValueError, match="whole heads"):
        kernels.rotary_(qkv[:, :100], d, pos, cos, sin)


def test_resolve_cpu_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    native = cpu_ops.resolve_cpu_ops("auto", cpu, torch.float32)
    assert native.mode == "native" and native.kernels is not None and not native.bf16_products
    bf16 = cpu_ops.resolve_cpu_ops("auto", cpu, torch.bfloat16)  # float32 model, bfloat16 products
    assert bf16.mode == "native" and bf16.bf16_products
    assert cpu_ops.resolve_cpu_ops("torch", cpu, torch.float32) == cpu_ops.TORCH_OPS
    assert cpu_ops.resolve_cpu_ops("native", torch.device("cuda"), torch.float32) == cpu_ops.TORCH_OPS
    with pytest.raises(ValueError, match="float32 or bfloat16 products, not torch.float16"):
        cpu_ops.resolve_cpu_ops("native", cpu, torch.float16)
    assert cpu_ops.resolve_cpu_ops("auto", cpu, torch.float16).mode == "onednn"
    monkeypatch.setattr(cpu_ops, "load_cpu_kernels", lambda isa="auto": KernelLoad(None, "no compiler in this test"))
    assert cpu_ops.resolve_cpu_ops("auto", cpu, torch.float32) == cpu_ops.CpuOps("onednn", None)
    with pytest.raises(ValueError, match="no compiler in this test"):
        cpu_ops.resolve_cpu_ops("native", cpu, torch.float32)


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2_bias")


def test_native_model_matches_the_torch_model(qwen2_folder: Path) -> None:
    """Same logits from the C kernels and from plain torch (q/k/v biases, GQA, decodes and prefills)."""
    runners = {ops: ModelRunner(ModelConfig(model=str(qwen2_folder), cpu_ops=ops, device="cpu", block_size=4),
                                progress=False)
               for ops in ("native", "torch")}
    native = runners["native"].model
    assert native.model.layers[0].self_attn.qkv_proj.packed is not None
    assert native.model.norm.kernels is not None and native.model.rotary.kernels is not None
    assert runners["torch"].model.model.norm.kernels is None
    logits = []
    for runner in runners.values():
        runner.init_kv_cache(64)
        states = [CachedRequestState(f"r{i}", list(range(3 + i, 3 + i + n)), n, SamplingParams(),
                               list(range(8 * i, 8 * i + 8)), 0) for i, n in enumerate((5, 19, 30))]
        prefill = build_batch(states, {s.req_id: len(s.token_ids) for s in states}, 4, torch.device("cpu"))
        with torch.inference_mode():
            runner.forward_logits(prefill, runner.kv_caches)
            for s in states:
                s.num_computed_tokens = len(s.token_ids)
                s.token_ids.append(7)
            decode = build_batch(states, {s.req_id: 1 for s in states}, 4, torch.device("cpu"))
            logits.append(runner.forward_logits(decode, runner.kv_caches))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
