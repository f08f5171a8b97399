"""Multi-LoRA with ``dtype="bfloat16"`` on the C kernels: a float32 model whose linear layers multiply in bfloat16,
the adapters' slots bfloat16 and their products the bfloat16 ones of ``cb_lora_add_bf16`` (x and x A^T rounded to
bfloat16, float32 sums). A tiny Llama's mixed batch (base-model rows, two adapters) tracks HF + PEFT run in
bfloat16 as ``test_bf16_products.py`` checks the base model: greedy tokens equal until a position where the two
models' top tokens are near-tied, where each one's token is in the other's top 5. The tiny random model is near-tied
often (HF's bfloat16 logits tie exactly at times), so past that point each of our tokens must still be among the
reference's top 5 given our own prefix: a batch that dropped its adapters fails that at every token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_testlib import save_tokenizer
from lora_testlib import make_adapter, peft_forced_top, peft_greedy_with_top, peft_model
from test_lora import PROMPTS
from worker_testlib import make_tiny_model

from cbserve import LLM, LoRARequest, SamplingParams
from cbserve.worker.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")

MAX_NEW = 12
TOP = 5


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def test_tiny_llama_adapters_in_bf16_track_peft_bf16(tmp_path: Path) -> None:
    base = make_tiny_model(tmp_path / "base", "llama_gqa")
    save_tokenizer(base)
    one = LoRARequest("one", 1, str(make_adapter(base, tmp_path / "one", 1, r=8)))
    two = LoRARequest("two", 2, str(make_adapter(base, tmp_path / "two", 2, r=4, targets=["q_proj", "v_proj"],
                                                 rslora=True)))
    loras = [None, one, two, one, one, None]  # PROMPTS[0] and [4] are one prompt: base and adapter
    llm = LLM(str(base), dtype="bfloat16", cpu_ops="native", attention_backend="cpu", enable_lora=True, max_loras=2,
              progress=False, device="cpu")
    runner = llm.executor.runner
    manager = runner.lora
    assert runner.dtype == torch.float32 and runner.model.ops.bf16_products  # bfloat16 products
    assert manager is not None and manager.step.kernels is not None  # the C kernel: cb_lora_add_bf16
    assert all(slots.a.dtype == slots.b.dtype == torch.bfloat16 for _, slots in manager.linears.values())
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(PROMPTS, sp, lora_request=loras, use_tqdm=False)
    llm.shutdown()
    models = {None: peft_model(base, None, torch.bfloat16), 1: peft_model(base, Path(one.lora_path), torch.bfloat16),
              2: peft_model(base, Path(two.lora_path), torch.bfloat16)}
    refs = [models[None if x is None else x.lora_int_id] for x in loras]
    assert peft_greedy_with_top(refs[0], PROMPTS[0], 4)[0] != peft_greedy_with_top(refs[4], PROMPTS[4], 4)[0]
    exact = 0
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        ours = out.outputs[0].token_ids
        theirs, their_top = peft_greedy_with_top(ref, PROMPTS[i], MAX_NEW, TOP)
        assert all(t in top for t, top in zip(ours, peft_forced_top(ref, PROMPTS[i], ours, TOP), strict=True)), i
        at = _first_difference(ours, theirs)
        if at is None:
            exact += 1
            continue
        our_top = [t for t, _ in (out.outputs[0].logprobs or [])[at].top]
        assert theirs[at] in our_top and ours[at] in their_top[at], (i, at, ours, theirs)
    assert exact >= 1  # some prompts agree token for token over all MAX_NEW tokens (two of six here)
