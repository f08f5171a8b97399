"""ModelRunner.update_weights (cbserve/worker/loading/weight_update.py): new HF-named weights loaded in place give
the outputs of a runner built with them and of HF transformers with them, on the torch ops, the C kernels (packed
weights re-packed, the layer driver rebound), oneDNN, compact GGUF weights and FP8; bad updates change nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from family_testlib import MAX_MODEL_LEN, make_family_model
from moe_testlib import make_tiny_moe
from worker_testlib import hf_greedy, make_tiny_model

from cbserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu.gguf_blocks import QuantBlocks, save_gguf_blocks
from cbserve.worker.cpu.linear import native_weight
from cbserve.worker.layers.fp8_linear import Fp8Weight
from cbserve.worker.runner.model_runner import ModelRunner

BLOCK = 4
PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 8
needs_cc = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


def greedy(runner: ModelRunner, prompt: list[int] = PROMPT, n: int = NEW_TOKENS) -> tuple[list[int], list[Any]]:
    """Greedy tokens and their logprobs, one request through the runner (prefill, then n - 1 decode steps)."""
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    blocks = list(range(-(-(len(prompt) + n) // BLOCK)))
    new = NewRequestData("g", list(prompt), len(prompt), sp, blocks, 0)
    out = runner.execute_model(SchedulerOutput([new], [], {"g": len(prompt)}, len(prompt)))
    tokens, logprobs = list(out.sampled_token_ids[0]), [out.logprobs[0]]
    for i in range(n - 1):
        cached = CachedRequestData("g", [], [], len(prompt) + i)
        out = runner.execute_model(SchedulerOutput([], [cached], {"g": 1}, 1))
        tokens += out.sampled_token_ids[0]
        logprobs.append(out.logprobs[0])
    runner.execute_model(SchedulerOutput(finished_req_ids={"g"}))
    return tokens, logprobs


def make_runner(
    folder: Path, cpu_ops: str = "torch", weights: Any = None, num_blocks: int | None = 32, **cfg: Any
) -> ModelRunner:
    """A runner with its KV cache (``num_blocks`` None: as many as ``kv_cache_memory_bytes`` holds)."""
    config = ModelConfig(model=str(folder), device="cpu", block_size=BLOCK, cpu_ops=cpu_ops, **cfg)
    runner = ModelRunner(config, progress=False, weights=weights)
    runner.init_kv_cache(runner.determine_num_blocks() if num_blocks is None else num_blocks)
    return runner


def random_hf(folder: Path, seed: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The folder's HF model with new random weights (seeded), and its state dict (HF names)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0))
    return hf, {k: v.clone() for k, v in hf.state_dict().items()}


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def make_q8_folder(folder: Path) -> Path:
    """The tiny Llama with its linear weights rounded to GGUF Q8_0 (by gguf-py) and the blocks kept beside them,
    as a converted GGUF folder has them: the C kernels read the blocks (compact weights)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    make_tiny_model(folder, "llama_gqa")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    blocks, q8 = {}, GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                raw = quantize(p.numpy(), q8)
                p.copy_(torch.from_numpy(np.asarray(dequantize(raw, q8))))
                blocks[name] = QuantBlocks("Q8_0", torch.from_numpy(raw))
    hf.save_pretrained(folder)
    save_gguf_blocks(folder, blocks)
    return folder


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_q8_folder(tmp_path_factory.mktemp("q8"))


@pytest.mark.parametrize("cpu_ops", ["torch", pytest.param("native", marks=needs_cc), "onednn"])
@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_update_equals_a_fresh_build_and_hf(cpu_ops: str, variant: str, request: pytest.FixtureRequest) -> None:
    if cpu_ops == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    folder = request.getfixturevalue(variant)
    hf, new = random_hf(folder, seed=7)
    runner = make_runner(folder, cpu_ops)
    before = greedy(runner)
    report = runner.update_weights(iter(list(new.items())))  # an iterator: read once
    tied = variant == "tied"
    assert report["num_tensors"] == len(new) - tied and report["skipped"] == (["lm_head.weight"] if tied else [])
    assert report["repacked"] == (0 if cpu_ops == "torch" else 2 * 4 + 1)  # 4 linears a layer, the LM head
    after = greedy(runner)
    assert after != before
    assert after == greedy(make_runner(folder, cpu_ops, weights=new.items()))  # tokens and logprobs, exactly
    assert after[0] == hf_greedy(hf, PROMPT, NEW_TOKENS)
    if cpu_ops == "native":  # re-packed for the kernels, dense copies released, the layer driver bound again
        model = runner.model
        assert model.native_layers is not None and model.model.layers[0].self_attn.qkv_proj.weight.numel() == 0
        assert native_weight(model.lm_head.packed) is not None
        assert model.lm_head.weight.numel() == (model.lm_head.weight.shape[0] * 64 if tied else 0)


@pytest.mark.parametrize("cpu_ops", ["torch", pytest.param("native", marks=needs_cc)])
def test_partial_update_equals_a_build_of_the_merged_state(gqa: Path, cpu_ops: str) -> None:
    _, new = random_hf(gqa, seed=11)
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    names += [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    runner = make_runner(gqa, cpu_ops)
    before = greedy(runner)
    report = runner.update_weights((n, new[n]) for n in names)
    assert report["num_tensors"] == 6 and report["repacked"] == (0 if cpu_ops == "torch" else 3)
    merged = {**checkpoint(gqa), **{n: new[n] for n in names}}
    after = greedy(runner)
    assert after != before and after == greedy(make_runner(gqa, cpu_ops, weights=merged.items()))


def test_part_of_a_fused_weight_on_the_torch_ops(gqa: Path) -> None:
    """The dense copy is kept on the torch ops: one part of qkv_proj alone is a valid update."""
    _, new = random_hf(gqa, seed=3)
    name = "model.layers.1.self_attn.k_proj.weight"
    runner = make_runner(gqa, "torch")
    runner.update_weights([(name, new[name])])
    merged = {**checkpoint(gqa), name: new[name]}
    assert greedy(runner) == greedy(make_runner(gqa, "torch", weights=merged.items()))


@needs_cc
def test_part_of_a_packed_fused_weight_is_refused(gqa: Path) -> None:
    _, new = random_hf(gqa, seed=5)
    runner = make_runner(gqa, "native")
    before = greedy(runner)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="missing") as e:
        runner.update_weights(
            [(q, new[q]), ("model.layers.1.mlp.up_proj.weight", new["model.layers.1.mlp.up_proj.weight"])]
        )
    msg = str(e.value)
    for part in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
    ):
        assert part in msg
    assert "q_proj" not in msg and "up_proj" not in msg
    assert greedy(runner) == before


@pytest.mark.parametrize("cpu_ops", ["torch", pytest.param("native", marks=needs_cc)])
def test_bad_names_and_shapes_are_refused_and_change_nothing(gqa: Path, cpu_ops: str) -> None:
    _, new = random_hf(gqa, seed=9)
    runner = make_runner(gqa, cpu_ops)
    before = greedy(runner)
    good = list(new.items())  # all valid, and loaded only if the whole update is
    with pytest.raises(ValueError, match="model.layers.0.self_attn.nope.weight") as e:
        runner.update_weights([*good, ("model.layers.0.self_attn.nope.weight", torch.zeros(4, 4))])
    assert "1 bad tensor" in str(e.value)
    bad_shape = [*good[:-1], ("model.layers.1.mlp.down_proj.weight", torch.zeros(64, 127))]
    with pytest.raises(ValueError, match=r"down_proj.weight: shape \(64, 127\), expected \(64, 128\)"):
        runner.update_weights(bad_shape)
    with pytest.raises(ValueError, match="has 10 rows"):  # a fused checkpoint tensor cut into its parts
        runner.update_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(10, 64))])
    with pytest.raises(ValueError, match="floating-point"):
        runner.update_weights([("model.norm.weight", torch.ones(64, dtype=torch.long))])
    assert greedy(runner) == before


@needs_cc
def test_compact_gguf_weights_are_repacked_as_float32(q8_folder: Path) -> None:
    runner = make_runner(q8_folder, "native")
    layer = runner.model.model.layers[0]
    # the checkpoint's blocks (their int16-rows variant where the defaults round rows to int16: a build with VNNI)
    assert native_weight(layer.mlp.down_proj.packed).panels.fmt in ("q8_0", "q8_0_i16all")
    hf, new = random_hf(q8_folder, seed=13)
    runner.update_weights(new.items())
    assert native_weight(layer.mlp.down_proj.packed).panels.fmt == "f32"  # no exact smaller format for these
    after = greedy(runner)
    assert after == greedy(make_runner(q8_folder, "native", weights=new.items()))
    assert after[0] == hf_greedy(hf, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", ["phi3_short", "gemma2", "qwen3_moe"])
def test_other_families(family: str, tmp_path: Path) -> None:
    """Phi-3's checkpoint-fused qkv_proj / gate_up_proj, Gemma's norms stored as 1 + w, Qwen-MoE's stacked experts."""
    folder = make_tiny_moe(tmp_path, family) if family == "qwen3_moe" else make_family_model(tmp_path, family)
    cpu_ops = "native" if cpu_native._compiler() is not None else "torch"
    cfg = {"max_model_len": MAX_MODEL_LEN.get(family)}
    _, new = random_hf(folder, seed=3)
    runner = make_runner(folder, cpu_ops, **cfg)
    before = greedy(runner)
    runner.update_weights(new.items())
    after = greedy(runner)
    assert after != before and after == greedy(make_runner(folder, cpu_ops, weights=new.items(), **cfg))


def test_fp8_layers_are_requantized_in_place(gqa: Path) -> None:
    _, new = random_hf(gqa, seed=17)
    runner = make_runner(gqa, "auto", quantization="fp8")
    packed = runner.model.model.layers[0].self_attn.qkv_proj.packed
    assert isinstance(packed, Fp8Weight)
    storage, before = packed.weight.data_ptr(), greedy(runner)
    report = runner.update_weights(new.items())
    assert report["repacked"] == 2 * 4
    assert runner.model.model.layers[0].self_attn.qkv_proj.packed is packed and packed.weight.data_ptr() == storage
    after = greedy(runner)
    assert after != before and after == greedy(make_runner(gqa, "auto", weights=new.items(), quantization="fp8"))
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="k_proj"):  # quantized: its dense copy is gone too
        runner.update_weights([(q, new[q])])
