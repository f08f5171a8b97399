"""A tiny random Llama (the bundled SmolLM2's tokenizer and chat template, 2 layers of width 64) and random PEFT
LoRA adapters on all of its projections, for the end-to-end LoRA tests (seconds to build)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_tiny_llama(dst: Path) -> Path:
    """A seeded random LlamaForCausalLM saved as an HF folder, with SmolLM2's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbserve.worker.model_loader import resolve_model

    src = resolve_model(None).folder
    ref = json.loads((src / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=ref["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=ref["bos_token_id"], eos_token_id=ref["eos_token_id"],
                      pad_token_id=ref.get("pad_token_id"), tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


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
