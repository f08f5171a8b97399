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


def peft_model(base: Path, adapter: Path | None) -> Any:
    """The HF reference of ``base`` with ``adapter`` applied (None: the base model), eager attention."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation without EOS, one prompt, no padding."""
    ids = torch.tensor([prompt])
    out = ids
    with torch.inference_mode():
        past = None
        step_ids = ids
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = res.logits[0, -1].argmax().view(1, 1)
            out = torch.cat([out, nxt], dim=1)
            step_ids = nxt
    return out[0, len(prompt) :].tolist()


def peft_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """The reference's logprob of each of ``tokens`` following ``prompt``."""
    seq = prompt + tokens
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[len(prompt) - 1 + j, t].item() for j, t in enumerate(tokens)]
