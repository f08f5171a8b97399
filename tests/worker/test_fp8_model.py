"""``quantization="fp8"`` and ``kv_cache_dtype="fp8"`` on a whole model, on CPU (the emulation): through the offline
``LLM`` each flag has its effect (FP8 linear weights, FP8 KV caches with the torch backend) and keeps the model close
to its unquantized self (benchmarks/bench_fp8_accuracy.py's measurement, checked on itself); a draft model follows
the target's settings; the KV budget buys more FP8 blocks; what cannot run FP8 is refused where the model is built."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tiny_llama import make_tiny_llama

from cbserve import LLM, SamplingParams
from cbserve.worker.attention import TorchAttentionBackend, get_attention_backend
from cbserve.worker.attention.kv_fp8 import Fp8KVCache
from cbserve.worker.config import ModelConfig
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear
from cbserve.worker.layers.fp8_linear import Fp8Weight
from cbserve.worker.loading.model_build import fp8_cpu_ops
from cbserve.worker.runner.model_runner import ModelRunner

CPU = {"device": "cpu", "max_model_len": 128, "progress": False}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [50, 60, 70]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("fp8_tiny"))


@pytest.fixture
def acc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/bench_fp8_accuracy.py, imported from its folder."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("bench_fp8_accuracy")


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def test_each_flag_has_its_effect_through_llm(folder: Path) -> None:
    llm = LLM(str(folder), **CPU, dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", num_kv_blocks=32)
    runner = llm.executor.runner
    assert runner.cpu_ops == "torch" and runner.backend_cls is TorchAttentionBackend  # "auto" -> the emulation
    layers = _linears(runner.model)
    assert len(layers) == 4 * 2 and all(isinstance(m.packed, Fp8Weight) and m.weight.numel() == 0 for m in layers)
    assert runner.model.lm_head.weight.dtype == torch.bfloat16  # the embeddings and LM head stay
    assert all(isinstance(kv, Fp8KVCache) for kv in runner.kv_caches)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    weights_only = LLM(str(folder), **CPU, quantization="fp8", num_kv_blocks=32).executor.runner
    assert not isinstance(weights_only.kv_caches[0], Fp8KVCache) and weights_only.kv_caches[0][0].dtype == torch.float32


def test_accuracy_measurement_against_bf16(folder: Path, acc: ModuleType) -> None:
    """Each variant's distributions differ from bf16's (its flag took effect) by little; bf16 against itself agrees
    exactly (the measurement compares like with like)."""
    fields = {"model": str(folder), **acc.CPU_FIELDS, "max_model_len": 128}
    variants = {**acc.VARIANTS, "same": {}}
    res = acc.measure(fields, PROMPTS, max_tokens=5, variants=variants)
    assert res["same"]["mean_kl"] == 0.0 and res["same"]["greedy_prefix_agreement"] == 1.0
    assert res["same"]["identical_sequences"] == 2 and res["same"]["top1_agreement"] == 1.0
    for name in acc.VARIANTS:
        r = res[name]
        assert 0.0 < r["mean_kl"] <= r["max_kl"] < 1.0, (name, r)
        assert 0.0 <= r["greedy_prefix_agreement"] <= 1.0 and 0.5 <= r["top1_agreement"] <= 1.0, (name, r)
    assert 0.0 <= res["bf16"]["top1_agreement"] <= 1.0


def test_a_draft_model_runs_with_the_targets_fp8_settings(folder: Path) -> None:
    """The target as its own draft (every draft accepted): the same greedy tokens as without speculation."""
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8", "num_kv_blocks": 32}
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(folder), **CPU, **fp8).generate(PROMPTS, sp)]
    spec = LLM(
        str(folder),
        **CPU,
        **fp8,
        speculative_config={"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3},
    )
    draft = spec.executor.runner.draft
    assert draft is not None and all(isinstance(kv, Fp8KVCache) for kv in draft.kv_caches)
    assert all(isinstance(m.packed, Fp8Weight) for m in _linears(draft.model))
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, sp)] == plain


def test_the_kv_budget_buys_more_fp8_blocks(folder: Path) -> None:
    """Same budget: bytes per block from e4m3 values and float32 scales (head_dim 16: 20 bytes per head and token
    against float32's 64)."""
    budget = 1 << 20
    runners = {
        kv: ModelRunner(
            ModelConfig(
                model=str(folder), device="cpu", cpu_ops="torch", kv_cache_dtype=kv, kv_cache_memory_bytes=budget
            ),
            progress=False,
        )
        for kv in ("auto", "fp8")
    }
    per_token_head = {
        kv: r.block_bytes() // (2 * r.num_layers * r.block_size * r.num_kv_heads) for kv, r in runners.items()
    }
    assert per_token_head == {"auto": 16 * 4, "fp8": 16 + 4}
    assert (
        runners["fp8"].determine_num_blocks()
        == budget // runners["fp8"].block_bytes()
        > runners["auto"].determine_num_blocks()
    )


def test_where_fp8_cannot_run_the_build_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    # cpu_ops "auto" resolves to the emulation; an FP8 KV cache alone keeps the linears' own ops
    assert fp8_cpu_ops(ModelConfig(quantization="fp8", device="cpu"), cpu) == "torch"
    assert fp8_cpu_ops(ModelConfig(kv_cache_dtype="fp8", cpu_ops="native", device="cpu"), cpu) == "native"
    with pytest.raises(ValueError, match="emulation on the torch ops"):
        fp8_cpu_ops(ModelConfig(quantization="fp8", cpu_ops="native", device="cpu"), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    with pytest.raises(ValueError, match=r"quantization='fp8': FP8 needs .* 8\.9 .*RTX A6000"):
        fp8_cpu_ops(ModelConfig(quantization="fp8", device="cpu"), torch.device("cuda", 0))
    assert get_attention_backend("auto", cpu, native_cpu=True, kv_fp8=True) is TorchAttentionBackend
    for name, device, match in (
        ("cpu", cpu, "does not read an FP8 KV cache"),
        ("flash", "cuda", "use 'triton'"),
        ("triton", cpu, "needs a CUDA device"),
    ):
        with pytest.raises(ValueError, match=match):
            get_attention_backend(name, device, kv_fp8=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FP8 path needs a CUDA GPU")
def test_fp8_on_the_gpu_against_bf16(folder: Path, acc: ModuleType) -> None:
    """The same measurement on CUDA, compiled: ``_scaled_mm`` and the Triton kernels' FP8 cache, decode steps from
    CUDA graphs; each variant close to bf16 and not equal to it."""
    fields = {"model": str(folder), "device": "cuda", "dtype": "bfloat16", "max_model_len": 128}
    res = acc.measure(fields, PROMPTS, max_tokens=8)
    for name in acc.VARIANTS:
        assert 0.0 < res[name]["mean_kl"] < 1.0 and res[name]["top1_agreement"] >= 0.5, (name, res[name])
