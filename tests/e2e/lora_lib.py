"""Random PEFT LoRA adapters on all of the projections of the tiny random Llama (tests/tiny_llama.py, re-exported
here), for the end-to-end LoRA tests (seconds to build)."""

from __future__ import annotations

from pathlib import Path

from tiny_llama import make_tiny_llama

__all__ = ["PROJECTIONS", "make_adapter", "make_tiny_llama"]

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model: Path, dst: Path, seed: int, rank: int = 8) -> Path:
    """A random rank-``rank`` LoRA adapter of ``model`` on every attention and MLP projection (PEFT's format)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(dst)
    return dst
