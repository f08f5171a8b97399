"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorms) with a sparse mixture-of-experts block on the layers
``decoder_sparse_step`` selects (layer i when (i + 1) % step == 0) and ``mlp_only_layers`` does not list; the
others keep a dense MLP of ``intermediate_size``. The router's top-k probabilities are renormalised only when
``norm_topk_prob``. Checkpoint names ``mlp.gate`` / ``mlp.experts.N.gate_proj/up_proj/down_proj``."""

from __future__ import annotations

from typing import Any

from torch import nn

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.layers.moe import MoEConfig, SparseMoeBlock
from cbserve.worker.models.moe_lm import MoEWeights
from cbserve.worker.models.qwen3 import Qwen3ForCausalLM

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def is_sparse_layer(cfg: Any, layer: int) -> bool:
    """HF's rule for which Qwen-MoE layers get the experts."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only_dense = getattr(cfg, "mlp_only_layers", None) or ()
    return layer not in only_dense and int(cfg.num_experts) > 0 and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(MoEWeights, Qwen3ForCausalLM):
    def build_mlp(self, cfg: Any, layer: int, kernels: CpuKernels | None) -> nn.Module:
        if is_sparse_layer(cfg, layer):
            return SparseMoeBlock(MoEConfig.qwen3_moe(cfg), kernels)
        return super().build_mlp(cfg, layer, kernels)


MODEL = Qwen3MoeForCausalLM
