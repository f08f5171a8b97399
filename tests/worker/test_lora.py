"""Multi-LoRA equals HF transformers + PEFT: greedy tokens of every adapter of a mixed batch (base-model rows
included) on tiny random Llama, Qwen3, Gemma 2 and Phi-3 models (Phi-3's adapters on its fused qkv_proj /
gate_up_proj), on the C kernels and on the torch path; through chunked prefill, prefix-cache hits (never shared
across adapters), preemption and a step limit of fewer adapters than the batch asks for; adapters kept in the
host LRU (never reloaded per request); bad adapters refused with the reason."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from family_testlib import MAX_MODEL_LEN, make_family_model, save_tokenizer
from lora_testlib import ALL_SPLIT, make_adapter, peft_greedy, peft_logprobs, peft_model
from worker_testlib import make_tiny_model

from cbserve import LLM, LoRARequest, SamplingParams
from cbserve.worker.lora.files import LoRAAdapterError
from cbserve.worker.lora.manager import LoRAManager

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
GREEDY_LP = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
PATHS = {"native": dict(cpu_ops="native", attention_backend="cpu", device="cpu"),
         "torch": dict(cpu_ops="torch", attention_backend="torch", device="cpu")}
SHARED = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
PROMPTS = [SHARED + [40], [30, 31, 32], SHARED + [41, 42, 43], list(range(50, 87)), SHARED + [40], [60, 61, 62, 63]]
# family -> (adapter targets of the first adapter, of the second)
FAMILY_TARGETS = {
    "llama": (ALL_SPLIT, ["q_proj", "v_proj"]),
    "qwen3": (ALL_SPLIT, ["k_proj", "o_proj", "down_proj"]),
    "gemma2": (ALL_SPLIT, ["q_proj", "up_proj"]),
    "phi3_short": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["qkv_proj"]),
}


def _base(folder: Path, family: str) -> Path:
    if family == "llama":
        make_tiny_model(folder, "llama_gqa")
        save_tokenizer(folder)
        return folder
    return make_family_model(folder, family)


@pytest.fixture(scope="module", params=list(FAMILY_TARGETS))
def family_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny model, two adapters (the second of rank 4 with rsLoRA) and PEFT's greedy tokens per prompt."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_{family}")
    base = _base(root / "base", family)
    t1, t2 = FAMILY_TARGETS[family]
    a1 = LoRARequest("one", 1, str(make_adapter(base, root / "one", 1, r=8, targets=t1)))
    a2 = LoRARequest("two", 2, str(make_adapter(base, root / "two", 2, r=4, targets=t2, rslora=True)))
    loras = [None, a1, a2, a1, a1, None]  # PROMPTS[0] and [4] are one prompt: base and adapter
    models = {None: peft_model(base, None), 1: peft_model(base, Path(a1.lora_path)),
              2: peft_model(base, Path(a2.lora_path))}
    ref_models = [models[None if x is None else x.lora_int_id] for x in loras]
    ref = [peft_greedy(m, p, MAX_NEW) for m, p in zip(ref_models, PROMPTS, strict=True)]
    ref_lps = [peft_logprobs(m, p, t) for m, p, t in zip(ref_models, PROMPTS, ref, strict=True)]
    # the adapter changes the distribution (a tiny Gemma 2 repeats its last token with or without it)
    moved = peft_logprobs(models[1], PROMPTS[0], ref[0])
    assert max(abs(x - y) for x, y in zip(ref_lps[0], moved, strict=True)) > 1e-2
    return family, base, loras, (ref, ref_lps)


@pytest.mark.parametrize("path", list(PATHS))
def test_mixed_batch_matches_peft(family_case: tuple, path: str) -> None:
    family, base, loras, (ref, ref_lps) = family_case
    llm = LLM(str(base), enable_lora=True, max_loras=2, progress=False, max_model_len=MAX_MODEL_LEN.get(family),
              **PATHS[path])
    manager = llm.executor.runner.lora
    assert manager is not None and (manager.step.kernels is not None) == (path == "native")  # the C kernel's path
    outs = llm.generate(PROMPTS, GREEDY_LP, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for out, expected in zip(outs, ref_lps, strict=True):
        got = [lp.logprob for lp in out.outputs[0].logprobs or []]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 1e-4
    llm.shutdown()


def _reference(base: Path, loras: list[LoRARequest | None], prompts: list[list[int]], n: int) -> list[list[int]]:
    models = {x.lora_int_id: peft_model(base, Path(x.lora_path)) for x in loras if x is not None}
    models[None] = peft_model(base, None)  # type: ignore[index]
    return [peft_greedy(models[None if x is None else x.lora_int_id], p, n)  # type: ignore[index]
            for p, x in zip(prompts, loras, strict=True)]


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    root = tmp_path_factory.mktemp("lora_llama")
    base = _base(root / "base", "llama")
    adapters = [LoRARequest(f"a{i}", i, str(make_adapter(base, root / f"a{i}", i, r=4 * i))) for i in (1, 2, 3)]
    return base, adapters, root


def test_one_adapter_slot_chunked_prefill_preemption_and_prefix_cache(llama_case: tuple,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """max_loras=1 with three adapters: a step holds one adapter, the others wait (never evicted while running);
    small steps chunk the prompts, a small cache preempts, and prefix hits stay within one adapter. Each adapter
    is read from disk once (max_cpu_loras=3 keeps all three)."""
    base, adapters, _ = llama_case
    loras = [adapters[0], adapters[1], None, adapters[2], adapters[0], adapters[1]]
    ref = _reference(base, loras, PROMPTS, MAX_NEW)
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=3, max_lora_rank=12, progress=False,
              max_num_batched_tokens=16, num_kv_blocks=12, block_size=4, max_model_len=48,
              device="cpu")  # 12 blocks: one request
    with caplog.at_level(logging.INFO, logger="cbserve.worker.lora.manager"):
        outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
        again = llm.generate(PROMPTS[:2], GREEDY, lora_request=loras[:2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.outputs[0].token_ids for o in again] == ref[:2]
    manager = llm.executor.runner.lora
    assert manager is not None and manager.num_loads == 3
    assert sum("loaded from" in r.getMessage() for r in caplog.records) == 3
    assert llm.engine.scheduler.kv.num_free_blocks == 12  # nothing leaked


def test_adapter_lru_evicts_past_max_cpu_loras(llama_case: tuple) -> None:
    base, adapters, _ = llama_case
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=12, progress=False, device="cpu")
    for lora in (adapters[0], adapters[1], adapters[0]):
        llm.generate(PROMPTS[1], GREEDY, lora_request=lora, use_tqdm=False)
    manager = llm.executor.runner.lora
    assert manager is not None and (manager.num_loads, manager.num_evictions) == (3, 2)


def _write_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_bad_adapters_are_refused_with_the_reason(llama_case: tuple, tmp_path: Path) -> None:
    base, adapters, root = llama_case
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, progress=False, device="cpu")
    with pytest.raises(LoRAAdapterError, match="rank 12 is over max_lora_rank 8"):
        llm.generate(PROMPTS[1], GREEDY, lora_request=adapters[2])
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
        llm.generate(PROMPTS[1], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    other = tmp_path / "other"  # an adapter of a model with another hidden size
    make_tiny_model(other, "llama_gqa")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32, "intermediate_size": 64}))
    from transformers import AutoConfig, LlamaForCausalLM

    LlamaForCausalLM(AutoConfig.from_pretrained(other)).save_pretrained(other)
    wrong = make_adapter(other, tmp_path / "wrong", 5, r=4)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        llm.generate(PROMPTS[1], GREEDY, lora_request=LoRARequest("wrong", 5, str(wrong)))
    dora = make_adapter(base, tmp_path / "dora", 6, r=4)
    _write_config(dora, use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        llm.generate(PROMPTS[1], GREEDY, lora_request=LoRARequest("dora", 6, str(dora)))
    base_llm = LLM(str(base), progress=False, device="cpu")
    with pytest.raises(ValueError, match="enable_lora=True"):
        base_llm.generate(PROMPTS[1], GREEDY, lora_request=adapters[0])
    assert root.exists()


def test_triton_lora_kernels_in_the_model(llama_case: tuple) -> None:
    """The CUDA path's Triton kernels (interpreted on CPU) in the model give PEFT's tokens on a mixed batch."""
    pytest.importorskip("triton")
    base, adapters, _ = llama_case
    loras = [None, adapters[0], adapters[1]]
    ref = _reference(base, loras, PROMPTS[:3], 2)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, progress=False, cpu_ops="torch",
              attention_backend="torch", device="cpu")
    runner = llm.executor.runner
    assert runner.lora is not None
    manager = LoRAManager(runner.model, runner.hf_config, 2, 8, 2, runner.dtype, runner.device, use_triton=True)
    runner.lora = manager  # every layer's slots replaced by the Triton kernels' layout
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # the interpreter is slow
    outs = llm.generate(PROMPTS[:3], params, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert manager.step.token_slots is not None  # the kernels' per-token slots were built
