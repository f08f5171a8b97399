"""Mixtral: Mistral's attention (its sliding window on every layer, when the config sets one) with a sparse
mixture-of-experts block in place of the MLP: a top-k softmax router, always renormalised over the chosen
experts. Checkpoint names ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.N.w1/w2/w3`` (see moe.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.layers.moe import MoEConfig, SparseMoeBlock
from cbserve.worker.models.causal_lm import CausalLM
from cbserve.worker.models.decoder import DecoderSpec, layer_windows
from cbserve.worker.models.moe_lm import MoEWeights

MODEL_TYPES = ("mixtral",)
ARCHITECTURES = ("MixtralForCausalLM",)


class MixtralForCausalLM(MoEWeights, CausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        return DecoderSpec(windows=layer_windows(cfg))

    def build_mlp(self, cfg: Any, layer: int, kernels: CpuKernels | None) -> nn.Module:
        return SparseMoeBlock(MoEConfig.mixtral(cfg), kernels)


MODEL = MixtralForCausalLM
