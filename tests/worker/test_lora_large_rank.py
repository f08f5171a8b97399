"""LoRA adapters of every rank vLLM takes (up to 512) equal HF + PEFT: rank 256 and 512 adapters in one mixed batch
(base-model rows included) on a tiny Llama (split q/k/v and gate/up checkpoints, put side by side in the fused
layers' slots: 3 x 512 columns) and a tiny Phi-3 (fused qkv_proj / gate_up_proj checkpoints), on the C kernels and
on the torch path; and ``max_lora_rank=256`` serving a rank-8 adapter (its slots 3 x 256 columns wide)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_testlib import ALL_SPLIT, make_adapter, peft_greedy, peft_logprobs, peft_model
from test_lora import PATHS, PROMPTS, _base

from cbserve import LLM, LoRARequest, SamplingParams

MAX_NEW = 6
GREEDY_LP = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
TARGETS = {"llama": ALL_SPLIT, "phi3_short": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
LOGPROB_TOL = 1e-3  # float32 sums over 512 (x 3) columns in another order than PEFT's


def _expected(base: Path, loras: list[LoRARequest | None], prompts: list[list[int]]) -> tuple[list, list]:
    models = {x.lora_int_id: peft_model(base, Path(x.lora_path)) for x in loras if x is not None}
    models[0] = peft_model(base, None)
    refs = [models[0 if x is None else x.lora_int_id] for x in loras]
    tokens = [peft_greedy(m, p, MAX_NEW) for m, p in zip(refs, prompts, strict=True)]
    return tokens, [peft_logprobs(m, p, t) for m, p, t in zip(refs, prompts, tokens, strict=True)]


@pytest.fixture(scope="module", params=list(TARGETS))
def wide_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_wide_{family}")
    base = _base(root / "base", family)
    r256 = LoRARequest("r256", 1, str(make_adapter(base, root / "r256", 1, r=256, targets=TARGETS[family])))
    r512 = LoRARequest("r512", 2, str(make_adapter(base, root / "r512", 2, r=512, targets=TARGETS[family],
                                                   rslora=True)))  # fmt: skip
    loras = [None, r256, r512, r256]
    tokens, logprobs = _expected(base, loras, PROMPTS[:4])
    base_lps = peft_logprobs(peft_model(base, None), PROMPTS[1], tokens[1])
    assert max(abs(x - y) for x, y in zip(logprobs[1], base_lps, strict=True)) > 1e-2  # the adapter tells
    return family, base, loras, tokens, logprobs


def _check(outs: list, tokens: list[list[int]], logprobs: list[list[float]]) -> None:
    assert [o.outputs[0].token_ids for o in outs] == tokens
    for out, expected in zip(outs, logprobs, strict=True):
        got = [lp.logprob for lp in out.outputs[0].logprobs or []]
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < LOGPROB_TOL


@pytest.mark.parametrize("path", list(PATHS))
def test_rank_256_and_512_adapters_match_peft(wide_case: tuple, path: str) -> None:
    family, base, loras, tokens, logprobs = wide_case
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=512, progress=False, max_model_len=128,
              **PATHS[path])  # fmt: skip
    manager = llm.executor.runner.lora
    assert manager is not None and (manager.step.kernels is not None) == (path == "native")
    qkv = manager.linears[(0, "self_attn.qkv_proj")][1]
    assert qkv.a.shape[1] == 3 * 512  # the fused q/k/v slot of rank 512
    _check(llm.generate(PROMPTS[:4], GREEDY_LP, lora_request=loras, use_tqdm=False), tokens, logprobs)
    parts = 3 if family == "llama" else 1  # split q/k/v side by side; a fused checkpoint's one A for all three
    assert sorted(qkv.used) == [parts * 256, parts * 512]  # both adapters in their slots, at their own ranks
    llm.shutdown()


def test_max_lora_rank_256_serves_a_rank_8_adapter(tmp_path: Path) -> None:
    base = _base(tmp_path / "base", "llama")
    r8 = LoRARequest("r8", 1, str(make_adapter(base, tmp_path / "r8", 3, r=8)))
    loras = [r8, None, r8]
    tokens, logprobs = _expected(base, loras, PROMPTS[:3])
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=256, progress=False, **PATHS["native"])
    manager = llm.executor.runner.lora
    assert manager is not None and manager.step.kernels is not None
    assert manager.linears[(1, "self_attn.qkv_proj")][1].a.shape[1] == 3 * 256
    _check(llm.generate(PROMPTS[:3], GREEDY_LP, lora_request=loras, use_tqdm=False), tokens, logprobs)
    llm.shutdown()
