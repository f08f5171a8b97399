"""GGUF files of every family transformers' GGUF loader maps, written here from tiny random HF models the way
llama.cpp writes them (``gguf_writer.py``): cbserve converts and serves each one with HF generate()'s greedy
tokens and its logprobs within 1e-4 when HF transformers loads the same file (``from_pretrained(dir,
gguf_file=...)``), on the CPU C kernels and on the torch reference path, through chunked prefill, prefix-cache
hits and preemption; five files have Q8_0 / Q4_0 / Q4_K_M (Q4_K and Q6_K; Q5_0 and Q8_0 where rows are not whole
256-value blocks) / Q5_K_M (Q5_K and Q6_K) weights, which the C kernels read as blocks. The families
transformers cannot load from GGUF are refused at load, with the reason, before anything is converted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from family_testlib import COMMON, FAMILIES, _randomize_norms, prompts
from gguf_writer import write_gguf
from test_model_families import PATHS, _check_logprobs
from worker_testlib import hf_greedy, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu.gguf_blocks import load_gguf_blocks
from cbserve.worker.cpu.linear import native_panels, native_weight
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.loading import model_info, model_loader
from cbserve.worker.loading.gguf_arch import GGUF_MODEL_TYPES
from cbserve.worker.runner.executor import LocalExecutor

MAX_NEW = 12
_DENSE = dict(num_hidden_layers=2, tie_word_embeddings=False)
_K_SHAPE = {**_DENSE, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}  # rows of whole 256-blocks
# case -> (HF config class, model class, config keys, GGUF architecture, general.name, tensor type)
CASES: dict[str, tuple[str, str, dict[str, Any], str, str, str | None]] = {
    # llama.cpp writes Mistral as "llama" (q/k rows permuted); transformers loads it as Llama
    "mistral": ("MistralConfig", "MistralForCausalLM", _DENSE, "llama", "Mistral 7B Tiny", None),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DENSE, "qwen2", "qwen2", None),  # q/k/v biases
    # head_dim 32 (not transformers' Qwen3 default of 128, which the loader keeps): cbserve reads it back
    "qwen3_q8_0": ("Qwen3Config", "Qwen3ForCausalLM", {**_DENSE, "head_dim": 32}, "qwen3", "qwen3", "Q8_0"),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True), "qwen3moe", "qwen3moe", None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", FAMILIES["gemma2"][2], "gemma2", "gemma2", None),  # tied
    # 6 layers: the loader's layer pattern (5 sliding, 1 global) has a global layer
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**FAMILIES["gemma3"][2], "num_hidden_layers": 6,
                                                         "layer_types": None}, "gemma3", "gemma3", None),
    # fused qkv and gate_up, Q4_0 weights
    "phi3_q4_0": ("Phi3Config", "Phi3ForCausalLM", _DENSE, "phi3", "phi3", "Q4_0"),
    # K-quants as most downloaded files mix them (Q4_K, Q6_K for v, down and the output): rows of 256-value blocks
    "llama_q4_k_m": ("LlamaConfig", "LlamaForCausalLM", _K_SHAPE, "llama", "llama", "Q4_K_M"),
    "qwen2_q5_k_m": ("Qwen2Config", "Qwen2ForCausalLM", _K_SHAPE, "qwen2", "qwen2", "Q5_K_M"),  # q/k/v biases
    # rows of 64 and 96 values, not whole K-quant blocks: llama.cpp's fallbacks, Q5_0 and Q8_0 (as Qwen2.5-0.5B's)
    "qwen2_q4_k_m_fallback": ("Qwen2Config", "Qwen2ForCausalLM", _DENSE, "qwen2", "qwen2", "Q4_K_M"),
}
# the GGUF types a file's weights have, and the panels of a layer's down and gate projections, the LM head and
# the fused q/k/v (Q4_K_M's q and k in Q4_K, its v in Q6_K: one weight in two formats)
KINDS = {"llama_q4_k_m": ({"Q4_K", "Q6_K"}, ("q6_k", "q4_k", "q6_k", ("q4_k", "q6_k"))),
         "qwen2_q5_k_m": ({"Q5_K", "Q6_K"}, ("q6_k", "q5_k", "q6_k", ("q5_k", "q6_k"))),
         "qwen2_q4_k_m_fallback": ({"Q5_0", "Q8_0"}, ("q8_0", "q5_0", "q8_0", ("q5_0", "q8_0")))}
# the config values transformers' GGUF loader drops, given to the HF reference (cbserve reads them itself)
REF_FIXES = {"qwen3_q8_0": {"head_dim": 32}, "qwen3moe": {"moe_intermediate_size": 32}}


def make_source(folder: Path, config_cls: str, model_cls: str, extra: dict[str, Any]) -> Path:
    """A tiny random HF model (seeded; norms, biases and routers made to matter), saved to ``folder``."""
    import transformers

    torch.manual_seed(99)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **extra})).eval()
    _randomize_norms(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "mlp.gate.weight")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def load_hf_gguf(path: Path, fixes: dict[str, Any] | None = None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key, value in (fixes or {}).items():
        setattr(cfg, key, value)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=cfg, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Conversions go to a temporary cache (not the user's)."""
    cache = tmp_path_factory.mktemp("cbserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CBSERVE_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module", params=list(CASES))
def gguf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    config_cls, model_cls, extra, arch, name, qtype = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    src = make_source(tmp / "src", config_cls, model_cls, extra)
    path = write_gguf(src, tmp / f"{request.param}.gguf", arch, name, qtype)
    return request.param, path, load_hf_gguf(path, REF_FIXES.get(request.param))


def test_gguf_converts_to_the_served_model_type(gguf_model: tuple[str, Path, Any]) -> None:
    """The start-up check (header only) and the converted folder agree with transformers on the family."""
    case, path, hf = gguf_model
    info = model_info.read_model_info(str(path))
    folder = model_loader.resolve_model(str(path)).folder
    converted = model_loader.load_hf_config(folder)
    assert info.model_type == converted.model_type == hf.config.model_type
    assert info.head_dim == model_info.head_dim_of(converted) == model_info.head_dim_of(hf.config)
    assert converted.num_hidden_layers == info.num_hidden_layers == CASES[case][2]["num_hidden_layers"]
    if case == "qwen3moe":
        assert info.moe_intermediate_size == converted.moe_intermediate_size == 32
    blocks, qtype = load_gguf_blocks(folder), CASES[case][5]
    if qtype is not None:  # every linear weight, the embedding and the LM head kept as blocks
        per_layer = 4 if case.startswith("phi3") else 7  # Phi-3: fused qkv and gate_up
        kinds = KINDS.get(case, ({qtype},))[0]
        assert len(blocks) == 2 + per_layer * 2 and {b.qtype for b in blocks.values()} == kinds
    else:
        assert blocks == {}


def test_the_conversion_holds_one_copy_of_the_weights(gguf_model: tuple[str, Path, Any], tmp_path: Path) -> None:
    """The converted weights are transformers' GGUF tensors taken directly (no model built around them: one
    float32 copy at the peak), for every family equal to the state of the model transformers loads from the
    file, and written as shards with an index that the loader reads back."""
    case, path, hf = gguf_model
    config = model_loader.load_hf_config(model_loader.resolve_model(str(path)).folder)
    lean = model_loader.dequantized_state(path, config)
    full = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        full.pop("lm_head.weight", None)
    assert lean.keys() == full.keys() and all(torch.equal(lean[k], full[k]) for k in full), case
    model_loader.save_sharded(dict(full), tmp_path, shard_bytes=max(t.nbytes for t in full.values()))
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    back = dict(model_loader.iter_weights(tmp_path, progress=False))
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


@pytest.mark.parametrize("path", list(PATHS))
def test_gguf_family_matches_hf(gguf_model: tuple[str, Path, Any], path: str,
                                caplog: pytest.LogCaptureFixture) -> None:
    case, gguf, hf = gguf_model
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts(5))]
    with caplog.at_level(logging.INFO, logger="cbserve.worker.models.native_layers"):
        executor = LocalExecutor(ModelConfig(model=str(gguf), **PATHS[path], block_size=4), num_blocks=36,
                                 progress=False)
    model = executor.runner.model
    if path == "native" and case != "qwen3moe":  # the one-call C layer driver runs the dense families
        assert model.native_layers is not None
    if path == "native" and CASES[case][5] is not None:  # the kernels read the GGUF blocks
        qtype = CASES[case][5]
        fmt = qtype.lower()
        down, gate_up, head, qkv = KINDS[case][1] if case in KINDS else (fmt, fmt, fmt, (fmt,))
        layer = model.model.layers[0]
        assert native_weight(layer.mlp.down_proj.packed).panels.fmt == down
        assert native_weight(model.lm_head.packed).panels.fmt == head
        assert native_weight(layer.mlp.gate_up_proj.packed).panels.fmt == gate_up
        assert tuple(p.fmt for p in native_panels(layer.self_attn.qkv_proj.packed)) == qkv
    run = run_engine(executor, reqs, block_size=4, num_blocks=36, max_num_batched_tokens=16, max_num_seqs=4,
                     join_at_step={"r2": 5, "r5": 9})
    assert run.num_preemptions > 0 and run.prefix_hits > 0
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, MAX_NEW), (case, rid)
        _check_logprobs(hf, prompt, run.tokens[rid][0], run.logprobs[rid][0])


# the cases whose weights are (partly) 4-8-bit blocks: cpu_decode_activations "int16" applies to them
INT16_CASES = ("phi3_q4_0", "llama_q4_k_m", "qwen2_q5_k_m", "qwen2_q4_k_m_fallback", "qwen3_q8_0")


@pytest.mark.parametrize("prefill", ["float32", "int16"])
def test_int16_decode_activations_keep_hf_greedy_tokens(gguf_model: tuple[str, Path, Any], prefill: str) -> None:
    """cpu_decode_activations "int16": the 4-8-bit block weights multiply decode steps' rows rounded to int16
    (csrc/rows_i16.c); with cpu_prefill_activations "int16", every step's rows, the prompts' chunks too. The tokens
    stay HF's greedy ones, the logprobs within 1e-2 (5e-3 seen: these random models' norms make outliers, which
    set their blocks' int16 step). A file with no such blocks is refused at load."""
    case, gguf, hf = gguf_model
    config = ModelConfig(**{**PATHS["native"], "cpu_decode_activations": "int16", "cpu_prefill_activations": prefill},
                         model=str(gguf), block_size=4)
    kernels = load_cpu_kernels().kernels
    if prefill == "int16" and kernels is not None and "i16_dot" not in kernels.isa_features:
        with pytest.raises(ValueError, match="cpu_prefill_activations 'int16' needs int16 multiply-adds"):
            LocalExecutor(config, num_blocks=36, progress=False)  # this CPU's build: refused (test_int16_rows.py)
        return
    if case not in INT16_CASES:
        with pytest.raises(ValueError, match="4-8-bit GGUF blocks .* and this model has none"):
            LocalExecutor(config, num_blocks=36, progress=False)
        return
    executor = LocalExecutor(config, num_blocks=36, progress=False)
    model = executor.runner.model
    suffix = "_i16all" if prefill == "int16" else "_i16"
    assert native_weight(model.model.layers[0].mlp.gate_up_proj.packed).panels.fmt.endswith(suffix)
    report = executor.runner.model.ops.report()
    assert report["cpu_decode_activations"] == "int16" and report["cpu_prefill_activations"] == prefill
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts(5))]
    run = run_engine(executor, reqs, block_size=4, num_blocks=36, max_num_batched_tokens=16, max_num_seqs=4,
                     join_at_step={"r2": 5})
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, MAX_NEW), (case, rid)
        _check_logprobs(hf, prompt, run.tokens[rid][0], run.logprobs[rid][0], tol=1e-2)


def test_auto_activations_are_int16_where_the_build_multiplies_int16_pairs(gguf_model: tuple[str, Path, Any]) -> None:
    """The defaults (cpu_decode_activations and cpu_prefill_activations "auto"): on a build with the ``i16_dot`` bit
    (AVX-512 VNNI, AVX-VNNI) a model of 4-8-bit blocks multiplies every step's rows rounded to int16 (the panels
    the int16 test above runs, its tokens HF's); a build without it, or a model of other formats (float
    weights), keeps the float32 products. /stats says which."""
    case, gguf, _ = gguf_model
    config = ModelConfig(model=str(gguf), cpu_ops="native", attention_backend="cpu", device="cpu", block_size=4)
    model = LocalExecutor(config, num_blocks=36, progress=False).runner.model
    kernels = load_cpu_kernels().kernels
    int16 = kernels is not None and "i16_dot" in kernels.isa_features and case in INT16_CASES
    report = model.ops.report()
    want = "int16" if int16 else "float32"
    assert (report["cpu_decode_activations"], report["cpu_prefill_activations"]) == (want, want), case
    fmts = [p.fmt for p in native_panels(model.model.layers[0].self_attn.qkv_proj.packed)]
    assert any(fmt.endswith("_i16all") for fmt in fmts) is int16, (case, fmts)


def test_gguf_architectures_are_the_ones_transformers_maps() -> None:
    """Every GGUF architecture cbserve loads is one transformers' GGUF loader maps, to a model type a family
    serves; every served family it maps is loaded (Mistral through "llama": gguf-py has no "mistral")."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from cbserve.worker.models.registry import supported_model_types

    hf_name = {"qwen3moe": "qwen3_moe"}
    for arch, model_type in GGUF_MODEL_TYPES.items():
        assert hf_name.get(arch, arch) in GGUF_SUPPORTED_ARCHITECTURES and model_type in supported_model_types()
    arch_of = {"qwen3_moe": "qwen3_moe", "gemma3_text": "gemma3"}
    mapped = {t for t in supported_model_types() if arch_of.get(t, t) in GGUF_SUPPORTED_ARCHITECTURES}
    assert mapped - {"mistral"} == set(GGUF_MODEL_TYPES.values())
    assert not {"gemma", "mixtral"} & set(GGUF_SUPPORTED_ARCHITECTURES)  # refused below


def _metadata_only(path: Path, arch: str) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


# refused file -> (how it is written: HF config class, model class, config keys, GGUF arch, general.name), what
# the refusal says, what transformers does with it
REFUSED = {
    "gemma": (("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2), "gemma", "gemma"), "Gemma 1", "raises"),
    "mixtral": (("MixtralConfig", "MixtralForCausalLM", dict(_DENSE, num_local_experts=4, num_experts_per_tok=2),
                 "llama", "Mixtral 8x7B Tiny"), "Mixtral", "LlamaForCausalLM"),  # dense, MLP left random
    "llama_named_mistral": (("MistralConfig", "MistralForCausalLM", _DENSE, "llama", "mistral"), "'mistral'",
                            "raises"),
    "qwen2moe": (None, "architecture 'qwen2moe' is not supported", None),  # mapped, but no family serves it
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_gguf_families_transformers_cannot_load_are_refused(case: str, tmp_path: Path, _cache_dir: Path) -> None:
    how, message, transformers_does = REFUSED[case]
    path = tmp_path / f"{case}.gguf"
    if how is None:
        _metadata_only(path, case)
    else:
        write_gguf(make_source(tmp_path / "src", *how[:3]), path, *how[3:])
        if transformers_does == "raises":
            with pytest.raises((ValueError, NotImplementedError)):
                load_hf_gguf(path)
        else:
            assert type(load_hf_gguf(path)).__name__ == transformers_does
    with pytest.raises(ValueError, match=message):
        model_info.read_model_info(str(path))  # the start-up check
    with pytest.raises(ValueError, match=message):
        model_loader.resolve_model(str(path))  # the worker's load
    assert not model_info.gguf_cache_folder(path).exists()  # refused before any conversion


def test_gguf_tokenizer_serves_text(tmp_path: Path) -> None:
    """The tokenizer the GGUF holds (byte-level BPE in its tokenizer.ggml.* keys) serves text: ``LLM.generate``
    on a text prompt gives the ids and the greedy continuation HF gets from the same file, detokenized."""
    from transformers import AutoTokenizer

    from cbserve import LLM

    config_cls, model_cls, extra, arch, name, qtype = CASES["gemma3"]
    path = write_gguf(make_source(tmp_path / "src", config_cls, model_cls, extra), tmp_path / "m.gguf", arch, name)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    text = "the rain on the shore is not a thing that others order"
    ids = tok(text)["input_ids"]
    assert len(ids) > 8 and max(ids) < COMMON["vocab_size"] and any(i >= 259 for i in ids)  # merged tokens
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, block_size=4, progress=False, device="cpu")
    try:
        out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    expected = hf_greedy(load_hf_gguf(path), ids, 8)
    assert out[0].prompt_token_ids == ids and out[0].outputs[0].token_ids == expected
    assert out[0].outputs[0].text == tok.decode(ids + expected)[len(tok.decode(ids)):]
