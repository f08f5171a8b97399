"""Random PEFT LoRA adapters for the tiny test models, and the HF + PEFT greedy reference they are checked
against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, seed: int, r: int = 8, targets: list[str] | None = None,
                 rslora: bool = False, alpha: int = 16, scale: float = 0.3) -> Path:
    """A PEFT adapter of ``base`` with random A and B (``scale``: their standard deviation), saved in ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_SPLIT, init_lora_weights=False,
                     use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path | None, dtype: torch.dtype = torch.float32) -> Any:
    """The HF reference of ``base`` with ``adapter`` applied (None: the base model), eager attention, everything
    (the adapter's weights too) in ``dtype``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    model = model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()
    return model.to(dtype)


def peft_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation without EOS, one prompt, no padding."""
    return peft_greedy_with_top(model, prompt, max_new_tokens)[0]


def peft_greedy_with_top(model: Any, prompt: list[int], max_new_tokens: int,
                         top: int = 1) -> tuple[list[int], list[list[int]]]:
    """``peft_greedy``'s tokens and, at each of them, the reference's ``top`` most likely tokens."""
    out: list[int] = []
    tops: list[list[int]] = []
    step_ids, past = torch.tensor([prompt]), None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tops.append(res.logits[0, -1].float().topk(top).indices.tolist())
            out.append(int(res.logits[0, -1].argmax()))
            step_ids = torch.tensor([[out[-1]]])
    return out, tops


def peft_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """The reference's logprob of each of ``tokens`` following ``prompt``."""
    seq = prompt + tokens
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]


def peft_forced_top(model: Any, prompt: list[int], tokens: list[int], top: int) -> list[list[int]]:
    """The reference's ``top`` most likely tokens at each of ``tokens``, given ``prompt`` and the tokens before it."""
    seq = prompt + tokens
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    return [logits[len(prompt) - 1 + j].topk(top).indices.tolist() for j in range(len(tokens))]
