"""Qwen3: the Llama layer with an RMSNorm over each head of q and of k (before the rotary embedding), no
q/k/v biases, and a sliding window on the layers its ``layer_types`` mark."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec, activation_of, layer_windows

MODEL_TYPES = ("qwen3",)
ARCHITECTURES = ("Qwen3ForCausalLM",)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=attn_bias, o_bias=attn_bias, act=activation_of(cfg), qk_norm=True,
                           windows=layer_windows(cfg))


MODEL = Qwen3ForCausalLM
