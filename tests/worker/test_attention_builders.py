"""The model runner owns a step's attention plan (issue 38): each backend class makes a metadata builder for the
model's layout, the runner (and the draft model, with its own) builds the plan once a step, before the forward
pass, and a backend's ``forward`` only reads it: without one of its type it raises instead of building one.
The CPU builder plans torch's fallback only for a layout the C kernel does not take; the Triton builder picks
the decode split count from the layout's kv heads unless a CUDA-graph runner fixed it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from worker_testlib import build_plan, fused_qkv, make_tiny_model, paged_metadata, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.attention import AttentionLayout, AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend
from cbserve.worker.attention.backend import AttentionBackend, AttentionMetadataBuilder, PreparedAttention
from cbserve.worker.attention.cpu_backend import CpuMetadataBuilder, CpuPrepared
from cbserve.worker.attention.torch_backend import TorchPrepared
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.runner.profiling import dummy_batch

needs_kernels = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
HQ, HKV, D, BS = 4, 2, 64, 16
CTX_Q = [(20, 1), (0, 1), (3, 9), (0, 12)]  # two decodes, a continued chunk, a fresh prompt
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _layout(dtype: torch.dtype = torch.float32, device: str = "cpu", hkv: int = HKV) -> AttentionLayout:
    return AttentionLayout(HQ, hkv, D, dtype, torch.device(device))


def _step(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple:
    """A mixed step's metadata (no plan), KV cache and q/k/v."""
    gen = torch.Generator().manual_seed(3)
    md = paged_metadata(CTX_Q, BS, 8, gen, device)
    cache = tuple(torch.randn(8, BS, HKV, D, generator=gen).to(dtype).to(device) for _ in range(2))
    return md, cache, fused_qkv(int(md.query_start_loc[-1]), HQ, HKV, D, gen, dtype, device)


def _refuses_without_its_plan(backend: AttentionBackend, other: PreparedAttention, device: str = "cpu",
                              dtype: torch.dtype = torch.float32) -> None:
    md, cache, (q, k, v) = _step(device, dtype)
    before = cache[0].clone()
    for plan in (None, other):
        md.prepared = plan
        with pytest.raises(RuntimeError, match="builder first"):
            backend.forward(q, k, v, cache, md)
        assert md.prepared is plan  # forward never builds nor stores a plan
    assert torch.equal(cache[0], before)  # nothing written either
    build_plan(backend, md, dtype, device)  # with its plan, the same call works
    assert backend.forward(q, k, v, cache, md).shape == q.shape


def test_torch_forward_without_a_plan_raises() -> None:
    _refuses_without_its_plan(TorchAttentionBackend(HQ, HKV, D, D**-0.5), CpuPrepared(None))  # type: ignore[arg-type]


@needs_kernels
def test_cpu_forward_without_a_plan_raises() -> None:
    be = CpuAttentionBackend(HQ, HKV, D, D**-0.5)
    md, _, _ = _step()
    _refuses_without_its_plan(be, TorchAttentionBackend.make_builder(_layout()).build(md))


@pytest.mark.cuda  # the GPU suite (`pytest -m cuda`)
def test_triton_forward_without_a_plan_raises(triton_kernels_module: Any) -> None:
    from cbserve.worker.attention.triton_backend import TritonAttentionBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    be = TritonAttentionBackend(HQ, HKV, D, D**-0.5)
    md, _, _ = _step(dev, dtype)
    _refuses_without_its_plan(be, TorchAttentionBackend.make_builder(_layout(dtype, dev)).build(md), dev, dtype)


@pytest.mark.cuda  # the GPU suite (`pytest -m cuda`)
def test_flash_forward_without_a_plan_raises() -> None:
    try:
        from cbserve.worker.attention.flash_backend import FlashAttentionBackend
    except ImportError as e:  # no CUDA, or no flash-attn build that works with this torch
        pytest.skip(f"flash-attn backend unavailable: {e}")
    be = FlashAttentionBackend(HQ, HKV, D, D**-0.5)
    md, _, _ = _step("cuda", torch.bfloat16)
    _refuses_without_its_plan(be, TorchAttentionBackend.make_builder(_layout()).build(md), "cuda", torch.bfloat16)


def test_cpu_builder_plans_the_torch_fallback_only_for_layouts_the_kernel_does_not_take() -> None:
    md = paged_metadata(CTX_Q, BS, 8, torch.Generator().manual_seed(0))
    f32 = CpuAttentionBackend.make_builder(_layout())
    assert isinstance(f32, CpuMetadataBuilder) and not f32.needs_fallback
    assert f32.build(md).fallback is None
    for layout in (_layout(torch.bfloat16), _layout(torch.float16), _layout(device="cuda")):
        builder = CpuAttentionBackend.make_builder(layout)
        plan = builder.build(md)
        assert isinstance(plan, CpuPrepared) and isinstance(plan.fallback, TorchPrepared), layout
        assert plan.fallback.buffer is builder.buffer  # the builder's scratch buffer, lent to every layer
        assert plan.rows.seq_lens.tolist() == f32.build(md).rows.seq_lens.tolist()


@needs_kernels
def test_cpu_forward_refuses_other_dtypes_on_a_float32_plan_and_takes_them_on_theirs() -> None:
    be, ref = CpuAttentionBackend(HQ, HKV, D, D**-0.5), TorchAttentionBackend(HQ, HKV, D, D**-0.5)
    md, cache, (q, k, v) = _step(dtype=torch.bfloat16)
    md_ref, cache_ref, _ = _step(dtype=torch.bfloat16)
    build_plan(be, md)  # a float32 layout: no fallback planned
    with pytest.raises(RuntimeError, match="float32 CPU layout"):
        be.forward(q, k, v, cache, md)
    build_plan(be, md, torch.bfloat16)
    build_plan(ref, md_ref, torch.bfloat16)
    assert torch.equal(be.forward(q, k, v, cache, md), ref.forward(q, k, v, cache_ref, md_ref))


def test_torch_builder_owns_one_scratch_buffer_for_every_step() -> None:
    builder = TorchAttentionBackend.make_builder(_layout())
    gen = torch.Generator().manual_seed(0)
    plans = [builder.build(paged_metadata(CTX_Q, BS, 8, gen)) for _ in range(2)]
    assert plans[0].buffer is plans[1].buffer is builder.buffer
    other = TorchAttentionBackend.make_builder(_layout())
    assert other.build(paged_metadata(CTX_Q, BS, 8, gen)).buffer is not builder.buffer


def test_triton_builder_splits_by_the_layouts_kv_heads_unless_fixed(triton_kernels_module: Any) -> None:
    from cbserve.worker.attention.triton_backend import TritonAttentionBackend, TritonPrepared, num_sms

    md = paged_metadata([(300, 1)] * 3 + [(0, 7)], BS, 100, torch.Generator().manual_seed(0))
    for hkv in (1, 8):
        plan = TritonAttentionBackend.make_builder(_layout(hkv=hkv)).build(md)
        want = triton_kernels_module.default_num_splits(3, hkv, 301, num_sms(torch.device("cpu")))
        assert isinstance(plan, TritonPrepared) and plan.num_splits == want and plan.prefill_max_q == 7
    md.decode_num_splits = 2  # a CUDA-graph runner's fixed split count wins
    assert TritonAttentionBackend.make_builder(_layout()).build(md).num_splits == 2


class CountingBuilder(AttentionMetadataBuilder):
    """Wraps a builder: counts its plans and remembers the last."""

    def __init__(self, inner: AttentionMetadataBuilder) -> None:
        super().__init__(inner.layout)
        self.inner, self.calls, self.last = inner, 0, None

    def build(self, md: AttentionMetadata) -> PreparedAttention:
        self.calls += 1
        self.last = self.inner.build(md)
        return self.last


def _count_forwards(model: torch.nn.Module, builder: CountingBuilder) -> list[int]:
    """Counts ``model``'s forward passes, each checked to run on the builder's latest plan."""
    calls, forward = [0], model.forward

    def counted(input_ids: torch.Tensor, positions: torch.Tensor, kv: Any, md: AttentionMetadata) -> torch.Tensor:
        assert md.prepared is not None and md.prepared is builder.last, "a forward pass without this step's plan"
        calls[0] += 1
        return forward(input_ids, positions, kv, md)

    model.forward = counted  # type: ignore[method-assign]
    return calls


def _count_steps(runner: Any) -> list[int]:
    steps, execute = [0], runner.execute_model

    def counted(so: Any) -> Any:
        steps[0] += so.total_num_scheduled_tokens > 0
        return execute(so)

    runner.execute_model = counted
    return steps


def _instrument(owner: Any) -> tuple[CountingBuilder, list[int]]:
    """Counts the plans of ``owner``'s builder (a runner's, a draft model's) and its model's forward passes."""
    builder = owner.attention_builder = CountingBuilder(owner.attention_builder)
    return builder, _count_forwards(owner.model, builder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("builders"), "llama_gqa")


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=needs_kernels)])
def test_the_runner_builds_the_plan_once_a_step(folder: Path, backend: str) -> None:
    cfg = ModelConfig(model=str(folder), attention_backend=backend, device="cpu")
    ex = LocalExecutor(dataclasses.replace(cfg, block_size=4), num_blocks=64, progress=False)
    runner = ex.runner
    model = runner.model
    assert not hasattr(model, "prepare_attention")
    assert model.attention_backend is runner.backend_cls
    assert model.attention_layout == AttentionLayout(4, 2, 16, torch.float32, torch.device("cpu"))
    builder, forwards = _instrument(runner)
    steps = _count_steps(runner)
    reqs = [(f"r{i}", list(range(3 + i, 12 + 3 * i)), GREEDY) for i in range(3)]
    run_engine(ex, reqs, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    assert steps[0] > 3 and builder.calls == forwards[0] == steps[0]
    kind = CpuPrepared if runner.backend_cls is CpuAttentionBackend else TorchPrepared
    assert type(builder.last) is kind
    before = builder.calls  # memory profiling's forward pass plans its own batch too
    assert runner.forward_logits(dummy_batch(runner, 24, 4), runner.allocate_kv_cache(8)) is not None
    assert builder.calls == forwards[0] == before + 1


def test_the_draft_model_builds_its_own_plan_for_each_of_its_passes(folder: Path, tmp_path: Path) -> None:
    from test_spec_draft_model import _tiny_draft

    draft = _tiny_draft(tmp_path / "draft")
    cfg = ModelConfig(model=str(folder), draft_model=str(draft), num_speculative_tokens=2, device="cpu")
    ex = LocalExecutor(dataclasses.replace(cfg, block_size=4), num_blocks=64, progress=False)
    runner = ex.runner
    assert runner.draft.model.attention_layout.num_heads == 2 and runner.draft.model.attention_layout.head_dim == 16
    target, target_forwards = _instrument(runner)
    drafts, draft_forwards = _instrument(runner.draft)
    steps = _count_steps(runner)
    run_engine(ex, [("a", [5, 6, 7, 8, 9], GREEDY), ("b", list(range(20, 33)), GREEDY)], block_size=4, num_blocks=64)
    assert target.calls == target_forwards[0] == steps[0]
    assert drafts.calls == draft_forwards[0] > steps[0]  # one pass over the step's batch, then its proposals
    assert target.inner is not drafts.inner
