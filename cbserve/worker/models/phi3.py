"""Phi-3: the Llama layer with q/k/v fused in the checkpoint (``qkv_proj``) and gate/up too
(``gate_up_proj``): each is cut into its parts when loaded, so tensor parallelism shards every part apart;
longrope ("su") rotary scaling with short and long factors (see ``rotary.compute_inv_freq`` for which set a
served context uses); a sliding window on every layer when the config sets one."""

from __future__ import annotations

from typing import Any

from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec, activation_of, layer_windows

MODEL_TYPES = ("phi3",)
ARCHITECTURES = ("Phi3ForCausalLM",)


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        if activation_of(cfg) != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported for phi3")
        return DecoderSpec(windows=layer_windows(cfg))


MODEL = Phi3ForCausalLM
