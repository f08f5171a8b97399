"""Tiny random mixture-of-experts models (Mixtral, Qwen3-MoE) saved with transformers as sharded safetensors
folders (per-expert checkpoint names) with a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from family_testlib import save_tokenizer

MOE_VARIANTS = ("mixtral", "mixtral_window", "qwen3_moe", "qwen3_moe_sparse_step")


def make_tiny_moe(folder: Path, variant: str) -> Path:
    """Save a tiny random MoE model (seeded, safetensors in small shards) and a tokenizer."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(4321)
    common = dict(
        vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    if variant in ("mixtral", "mixtral_window"):  # the window is shorter than most prompts of the tests
        window = 12 if variant == "mixtral_window" else None
        cfg = MixtralConfig(intermediate_size=96, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2,
                            sliding_window=window, **common)
        model = MixtralForCausalLM(cfg)
    elif variant == "qwen3_moe":  # unnormalised top-k, a dense layer among the sparse ones
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3, num_experts=8,
                             num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1], head_dim=32,
                             **common)
        model = Qwen3MoeForCausalLM(cfg)
    elif variant == "qwen3_moe_sparse_step":  # every second layer sparse, normalised top-k, a sliding window
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=4, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                             use_sliding_window=True, sliding_window=12, **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(variant)
    with torch.no_grad():  # HF initialises the router and the q/k norms flat: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    model.eval()
    model.save_pretrained(folder, max_shard_size="100KB")
    save_tokenizer(folder)
    return folder
