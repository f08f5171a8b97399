"""Tiny random mixture-of-experts models (Mixtral, Qwen3-MoE) saved with transformers, with a tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_VARIANTS = ("mixtral", "mixtral_window", "qwen3_moe", "qwen3_moe_sparse_step")


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` ids (0 unk, 1 bos, 2 eos, then ``w3`` ...) saved into
    ``folder``, so the model folder loads like a real one (``LLM``, the server)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def make_tiny_moe(folder: Path, variant: str) -> Path:
    """Save a tiny random MoE model (seeded, safetensors, per-expert checkpoint names) and its tokenizer."""
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
    elif variant == "qwen3_moe_sparse_step":  # every second layer sparse, normalised top-k
        cfg = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=4, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, **common)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(variant)
    with torch.no_grad():  # HF initialises the router and the q/k norms flat: make them matter
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    model.eval()
    model.save_pretrained(folder)
    save_word_tokenizer(folder, cfg.vocab_size)
    return folder
