"""Tiny random models of every architecture family, saved with transformers as sharded safetensors folders
with a word-level tokenizer, and the HF reference they are checked against."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

WINDOW = 8  # the sliding window of the tiny models: every test prompt is longer
VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
_FACTORS = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
# name -> the HF model class's module path, its config's extra keys
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW, num_hidden_layers=2,
                                                             tie_word_embeddings=False)),
    # layer 0 global, layers 1-2 sliding (max_window_layers)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                       max_window_layers=1, num_hidden_layers=3,
                                                       tie_word_embeddings=False)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, num_hidden_layers=3, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # longrope with the short factors: no sequence outgrows original_max_position_embeddings (max_model_len)
    "phi3_short": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_hidden_layers=2, sliding_window=12, tie_word_embeddings=False, original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "original_max_position_embeddings": 128, **_FACTORS})),
    # the long factors: every prompt is longer than original_max_position_embeddings
    "phi3_long": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_hidden_layers=2, tie_word_embeddings=False, original_max_position_embeddings=16,
        rope_scaling={"type": "su", "original_max_position_embeddings": 16, **_FACTORS})),
}
# engine max_model_len per family (None: the model's own)
MAX_MODEL_LEN = {"phi3_short": 128}


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("w0".."w319"; w1 = BOS, w2 = EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0",
                                   pad_token="w0")
    fast.save_pretrained(folder)


def _randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights are initialised to 1 (or 0 for Gemma's 1 + w): make them matter."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))


def make_family_model(folder: Path, family: str, overrides: dict[str, Any] | None = None) -> Path:
    """Save a tiny random ``family`` model (seeded, safetensors in small shards) and a tokenizer;
    ``overrides``: config values other than the family's (e.g. a head_dim the C kernels specialise)."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(1234)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **(overrides or {})})
    model = getattr(transformers, model_name)(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(folder, max_shard_size="100KB")
    save_tokenizer(folder)
    return folder


def load_hf(folder: Path) -> Any:
    """The HF reference, with eager attention (Gemma 2's soft-capping needs it; the same for all)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def prompts(seed: int, min_len: int = 1) -> list[list[int]]:
    """Mixed lengths, most longer than the window, three sharing a 21-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(21)]
    out = [shared + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (1, 6, 13)]
    out += [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (max(min_len, 5), 17, 37, 70)]
    return out
