"""Gemma 2: embeddings scaled by sqrt(hidden), (1 + w) RMSNorms, GeGLU (gelu, tanh approximation), norms
after attention and before and after the MLP, attention logits soft-capped, the query scaled by
``query_pre_attn_scalar ** -0.5``, sliding-window and global layers interleaved (``layer_types``), final
logits soft-capped. Tied embeddings."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec, activation_of, layer_windows

MODEL_TYPES = ("gemma2",)
ARCHITECTURES = ("Gemma2ForCausalLM",)


def gemma_spec(cfg: Any, **extra: Any) -> DecoderSpec:
    """The parts Gemma 2 and Gemma 3 share."""
    attn_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderSpec(
        qkv_bias=attn_bias, o_bias=attn_bias, act=activation_of(cfg), gemma_norms=True, sandwich_norms=True,
        embed_scale=float(cfg.hidden_size) ** 0.5, attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        final_softcap=getattr(cfg, "final_logit_softcapping", None), windows=layer_windows(cfg), **extra,
    )


class Gemma2ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        return gemma_spec(cfg, attn_softcap=getattr(cfg, "attn_logit_softcapping", None))


MODEL = Gemma2ForCausalLM
