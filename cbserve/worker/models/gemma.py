"""Gemma (the first): the Llama layer with embeddings scaled by sqrt(hidden), (1 + w) RMSNorms and GeGLU
(``hidden_act``, gelu with the tanh approximation). Tied embeddings."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import ACTIVATIONS, DecoderSpec

MODEL_TYPES = ("gemma",)
ARCHITECTURES = ("GemmaForCausalLM",)


class GemmaForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        act = getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"  # HF's GemmaMLP reads hidden_act
        if act not in ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {act!r} is not supported for gemma ({', '.join(ACTIVATIONS)})")
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, act=ACTIVATIONS[act], gemma_norms=True,
                           embed_scale=float(cfg.hidden_size) ** 0.5)


MODEL = GemmaForCausalLM
