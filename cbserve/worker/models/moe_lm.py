"""What every mixture-of-experts family adds to ``CausalLM`` (a mixin, listed before the family's base):
the expert and router checkpoint names (per expert, as checkpoints store them, or stacked 3-D, as
transformers 5 holds them), and the reason the one-call C layer driver declines the model."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from cbserve.worker.layers.moe import SparseMoeBlock, cuda_graphs_blocker, map_expert_name, split_stacked


class MoEWeights:
    model: Any

    def map_name(self, name: str) -> tuple[str, int | None]:
        return map_expert_name(name) or super().map_name(name)  # type: ignore[misc]

    def _pieces(
        self, name: str, tensor: torch.Tensor, params: Mapping[str, nn.Parameter]
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        prefix, _, kind = name.rpartition(".experts.")
        if kind not in ("gate_up_proj", "down_proj"):  # not stacked
            yield from super()._pieces(name, tensor, params)  # type: ignore[misc]
            return
        prefix = prefix.replace(".block_sparse_moe", ".mlp")
        block = self.get_submodule(prefix)  # type: ignore[attr-defined]
        if not isinstance(block, SparseMoeBlock):
            raise ValueError(f"unexpected weight {name!r} in checkpoint: {prefix} is no sparse block")
        for i, shard, piece in split_stacked(kind, tensor, block.moe.num_experts, block.moe.intermediate_size):
            yield f"{prefix}.experts.{i}.{kind}.weight", shard, piece

    @property
    def cuda_graphs_blocker(self) -> str | None:
        """Why decode steps cannot be captured as CUDA graphs (see cuda_graphs.py), None when they can."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return cuda_graphs_blocker(b.experts[0].gate_up_proj.weight for b in blocks) if blocks else None

    def driver_blocker(self) -> str | None:
        if any(isinstance(layer.mlp, SparseMoeBlock) for layer in self.model.layers):
            return "mixture-of-experts blocks (the driver runs dense MLPs only)"
        return super().driver_blocker()  # type: ignore[misc]
