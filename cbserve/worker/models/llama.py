"""The Llama family: Llama 2/3 (and SmolLM2), Mistral (its sliding window on every layer) and Qwen2 (q/k/v
biases; a sliding window on the layers its ``layer_types`` mark). GQA, RoPE scaling, tied embeddings."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec, activation_of, layer_windows

MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class LlamaForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        if activation_of(cfg) != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported for {cfg.model_type}")
        qwen2 = cfg.model_type == "qwen2"
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=attn_bias or qwen2, o_bias=attn_bias and not qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)), windows=layer_windows(cfg),
        )


MODEL = LlamaForCausalLM
