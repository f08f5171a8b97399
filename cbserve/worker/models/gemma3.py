"""Gemma 3 (text; ``Gemma3ForCausalLM``, config ``gemma3_text``): Gemma 2's layer (see ``gemma2.py``) with
(1 + w) RMSNorms over each head of q and k, its sliding-window layers on their own rotary base
(``rope_local_base_freq``: the "sliding_attention" rope parameters) and the global layers on theirs (with
their scaling), and soft-capping only where the config asks for it. The multimodal ``gemma3`` checkpoint
(``Gemma3ForConditionalGeneration``) is not served."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec
from cbserve.worker.models.gemma2 import gemma_spec

MODEL_TYPES = ("gemma3_text",)
ARCHITECTURES = ("Gemma3ForCausalLM",)


class Gemma3ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        if getattr(cfg, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention is not a causal LM")
        types = tuple(cfg.layer_types)
        return gemma_spec(cfg, qk_norm=True, attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
                          local_rope=tuple(t == "sliding_attention" for t in types))


MODEL = Gemma3ForCausalLM
