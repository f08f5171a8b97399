"""The one-call C layer driver (worker/models/native_layers.py, cpu/csrc/layers.c) against the per-module path it
replaces:
the same hidden states and the same KV cache, bit for bit, on prefill, mixed and decode steps, with q/k/v,
o_proj and MLP biases, sliding windows, per-head q/k norms (Qwen3, Gemma 3) and Gemma's layer. Greedy equality
with HF on the driver is covered by test_model_equivalence.py, test_model_families.py and
test_gguf_smollm2.py (the driver is on by default on CPU)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from family_testlib import make_family_model
from worker_testlib import make_tiny_model

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.models.native_layers import NativeLayers
from cbserve.worker.runner.input_batch import CachedRequestState, build_batch
from cbserve.worker.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
BS = 4


def _llama_all_biases(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, attention_bias=True, mlp_bias=True,
                      max_position_embeddings=256, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["qwen2_bias", "llama_all_biases", "mistral", "qwen3", "gemma2", "gemma3"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "llama_all_biases":
        folder = _llama_all_biases(folder)
    elif request.param in ("mistral", "qwen3", "gemma2", "gemma3"):  # a sliding window of 8 (all), q/k norms
        # (Qwen3, Gemma 3), Gemma's norms and GeGLU, soft-capping (Gemma 2), a local rope (Gemma 3)
        folder = make_family_model(folder, request.param)
    else:
        folder = make_tiny_model(folder, request.param)
    r = ModelRunner(ModelConfig(model=str(folder), device="cpu", block_size=BS), progress=False)
    r.init_kv_cache(64)
    return r


def _forward(runner: ModelRunner, states: list[CachedRequestState], counts: dict[str, int],
             native: bool) -> torch.Tensor:
    model = runner.model
    saved, model.native_layers = model.native_layers, (model.native_layers if native else None)
    try:
        batch = build_batch(states, counts, BS, torch.device("cpu"))
        batch.metadata.prepared = runner.attention_builder.build(batch.metadata)  # as the runner plans a step
        if native:  # the step really goes through the driver
            assert model.native_layers.applies(batch.input_ids.shape[0], batch.metadata)
        with torch.inference_mode():
            return model(batch.input_ids, batch.positions, runner.kv_caches, batch.metadata).clone()
    finally:
        model.native_layers = saved


def _same_step(runner: ModelRunner, states: list[CachedRequestState], counts: dict[str, int]) -> None:
    """The step through the driver and through the modules: equal hidden states and KV writes."""
    assert runner.model.native_layers is not None
    native = _forward(runner, states, counts, native=True)
    cache_after_native = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    modules = _forward(runner, states, counts, native=False)  # writes the same slots again
    assert torch.equal(native, modules)
    for (k1, v1), (k2, v2) in zip(cache_after_native, runner.kv_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for s in states:
        s.num_computed_tokens += counts[s.req_id]


def test_driver_equals_the_module_path_on_prefill_mixed_and_decode_steps(runner: ModelRunner) -> None:
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 6)]
    states = [CachedRequestState(f"r{i}", p, len(p), SamplingParams(), list(range(10 * i, 10 * i + 10)), 0)
              for i, p in enumerate(prompts)]
    _same_step(runner, states[:2], {"r0": 3, "r1": 7})  # prefill, r1 chunked
    states[0].token_ids.append(9)
    _same_step(runner, states, {"r0": 1, "r1": 4, "r2": 6})  # a decode, a later chunk, a new prompt
    for step in range(3):  # decode-only steps
        for s in states:
            s.token_ids.append(11 + step)
        _same_step(runner, states, {s.req_id: 1 for s in states})


def test_driver_refuses_bad_arguments(runner: ModelRunner) -> None:
    layers: NativeLayers = runner.model.native_layers
    args = layers.args
    x = torch.zeros(2, args.hidden)
    pos, slots = torch.zeros(2, dtype=torch.long), torch.tensor([0, 64 * BS], dtype=torch.long)  # slot past the end
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    layers._bind(runner.kv_caches)
    with pytest.raises(RuntimeError, match="outside its table"):
        layers.kernels.llama_layers(args, layers.layers, x, pos, slots, tables, lens, 1)
    with pytest.raises(ValueError, match="contiguous float32"):
        layers.kernels.llama_layers(args, layers.layers, torch.zeros(2, args.hidden + 1), pos, slots, tables, lens, 1)
    with pytest.raises(ValueError, match="exceeds the block table"):
        layers.kernels.llama_layers(args, layers.layers, x, pos, slots, tables, lens, BS + 1)
    with pytest.raises(ValueError, match="KV caches"):
        layers._bind(runner.kv_caches[:1])


def test_driver_follows_a_reallocated_kv_cache_without_holding_the_old_one(runner: ModelRunner) -> None:
    import gc
    import weakref

    layers: NativeLayers = runner.model.native_layers
    old = runner.kv_caches
    probe = weakref.ref(old[0][0])
    states = [CachedRequestState("a", [5, 6, 7], 3, SamplingParams(), [0, 1], 0)]
    _forward(runner, states, {"a": 3}, native=True)
    assert layers.layers[0].k_cache == old[0][0].data_ptr()
    runner.init_kv_cache(32)  # a new cache, as after a restart of the engine
    del old
    gc.collect()
    assert probe() is None  # the driver did not keep the old cache alive
    out = _forward(runner, states, {"a": 3}, native=True)
    assert layers.layers[0].k_cache == runner.kv_caches[0][0].data_ptr() and layers.args.num_blocks == 32
    assert torch.equal(out, _forward(runner, states, {"a": 3}, native=False))
    runner.init_kv_cache(64)  # back to the size the other tests use


def test_driver_is_used_only_where_it_applies(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama_gqa")
    assert ModelRunner(ModelConfig(model=str(folder), device="cpu", block_size=BS),
                       progress=False).model.native_layers is not None
    for kw in ({"cpu_ops": "torch"}, {"cpu_ops": "onednn"}, {"attention_backend": "torch"}):
        cfg = ModelConfig(model=str(folder), device="cpu", **kw)
        assert ModelRunner(dataclasses.replace(cfg, block_size=BS), progress=False).model.native_layers is None, kw


def test_layers_the_driver_lacks_run_module_by_module_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from cbserve.worker.models.causal_lm import CausalLM

    monkeypatch.setattr(CausalLM, "driver_blocker", lambda self: "a block the driver lacks")
    folder = make_tiny_model(tmp_path, "llama_gqa")
    with caplog.at_level(logging.INFO, logger="cbserve.worker.models.native_layers"):
        runner = ModelRunner(ModelConfig(model=str(folder), device="cpu", block_size=BS), progress=False)
    assert runner.model.native_layers is None
    lines = [r.getMessage() for r in caplog.records if "module by module" in r.getMessage()]
    assert lines == ["decoder layers run module by module (no C layer driver: llama layers have a block the driver "
                     "lacks)"]
