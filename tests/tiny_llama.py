"""A tiny random Llama over the bundled SmolLM2's tokenizer and chat template (2 layers of width 64; seconds to
build), and its fault-injection variant (``cbserve/worker/faults.py``): the test model whose worker fails when a
chosen token runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TRIGGER = 9999  # the fault model's trigger token (an ordinary word piece of SmolLM2's vocabulary)


def make_tiny_llama(dst: Path, extra_config: dict[str, Any] | None = None) -> Path:
    """A seeded random LlamaForCausalLM saved as an HF folder, with SmolLM2's tokenizer files; ``extra_config``:
    keys added to its config.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbserve.worker.loading.model_loader import resolve_model

    src = resolve_model(None).folder
    ref = json.loads((src / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=ref["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.2, bos_token_id=ref["bos_token_id"], eos_token_id=ref["eos_token_id"],
                      pad_token_id=ref.get("pad_token_id"), tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).eval().save_pretrained(dst)
    if extra_config:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **extra_config}, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


def make_fault_model(dst: Path, point: str, token_id: int = TRIGGER) -> Path:
    """The tiny Llama whose worker fails at ``point`` ("forward", "mask" or "exit") when ``token_id`` runs."""
    return make_tiny_llama(dst, {"cbserve_fault_injection": {"point": point, "token_id": token_id}})
