"""``CausalLM``: the causal language model every family is, over a flattened, unpadded token batch and a
paged KV cache, with tensor parallelism, tied embeddings and the CPU fast path (compact weights, the one-call
C layer driver where a family's layer math is Llama's). A family subclasses it with its ``decoder_spec``
(and, for other MLPs such as mixture-of-experts, ``build_mlp`` and ``map_name``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from cbserve.worker.attention.backend import AttentionBackend, AttentionLayout, AttentionMetadata, KVCache
from cbserve.worker.cpu.gguf_blocks import QuantBlocks, SplitBlocks, fuse_blocks
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.ops import TORCH_OPS, CpuOps, pack_weights
from cbserve.worker.layers.basic import ColumnParallelLinear, ParallelLMHead
from cbserve.worker.layers.rotary import Rope
from cbserve.worker.models.decoder import DecoderLayer, DecoderModel, DecoderSpec, GatedMLP
from cbserve.worker.models.native_layers import NativeLayers
from cbserve.worker.parallel import tp_world_size

logger = logging.getLogger(__name__)

# checkpoint projection -> (fused parameter, index of its part: the shard_id of the fused weight_loader)
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """``forward`` returns the final hidden states (before the last norm) of every token;
    ``compute_logits`` takes only the rows to sample.

    ``ops`` (``cpu.ops.resolve_cpu_ops``) chooses the CPU kernels the model is built on: with the native
    ops, the norms, the activation and the rotary embedding run on cbserve's C kernels. After
    ``load_weights``, ``finish_loading`` packs the linear weights for those ops and, where it applies,
    binds the C driver that runs every decoder layer of a step in one call.

    ``attention_backend`` and ``attention_layout`` say which attention backend class the layers were built
    with and for what heads, dtype and device: the model runner makes the backend's metadata builder from
    them and sets each step's plan (``AttentionMetadata.prepared``) before ``forward``."""

    def __init__(
        self, cfg: Any, backend_cls: type[AttentionBackend], max_positions: int, ops: CpuOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.spec = self.decoder_spec(cfg)
        kernels = ops.kernels
        layers = [
            DecoderLayer(cfg, self.spec, i, backend_cls, self.build_mlp(cfg, i, kernels), kernels)
            for i in range(cfg.num_hidden_layers)
        ]
        self.model = DecoderModel(cfg, self.spec, layers, max_positions, kernels)
        attn = layers[0].self_attn  # this rank's heads (every layer's); dtype, device: the parameters'
        self.attention_backend = backend_cls
        self.attention_layout = AttentionLayout(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                torch.get_default_dtype(), torch.get_default_device())
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Bound by finish_loading (native ops): runs all decoder layers of a step in one C call.
        self.native_layers: NativeLayers | None = None
        # With LoRA (worker/lora/manager.py): the step's adapters; a step that has some runs the module path.
        self.lora_step: Any = None

    # ---- what a family says ------------------------------------------------------------------------
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        """How this family's layers depart from Llama's (a family overrides it)."""
        return DecoderSpec()

    def build_mlp(self, cfg: Any, layer: int, kernels: CpuKernels | None) -> nn.Module:
        """Layer ``layer``'s feed-forward block (dense gated MLP; mixture-of-experts families override)."""
        return GatedMLP(cfg, self.spec, kernels)

    def map_name(self, name: str) -> tuple[str, int | None]:
        """A checkpoint tensor's parameter, and which part of a fused parameter it is (None: all of it)."""
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in FUSED_PARTS:
                fused, shard = FUSED_PARTS[p]
                parts[i] = fused
                return ".".join(parts), shard
        return name, None

    def driver_blocker(self) -> str | None:
        """Why the one-call C layer driver cannot run this model's layers (None: it can, see cpu/layers.py)."""
        if any(not isinstance(layer.mlp, GatedMLP) for layer in self.model.layers):
            return "a feed-forward block other than the dense gated MLP"
        return self.spec.driver_blocker()

    # ---- running -----------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], md: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states of every token; ``md.prepared`` must hold the step's attention plan (built by
        the runner with ``attention_backend.make_builder(attention_layout)``)."""
        x = self.embed(input_ids)
        adapters = self.lora_step is not None and self.lora_step.runs
        if self.native_layers is not None and not adapters and self.native_layers.applies(x.shape[0], md):
            return self.native_layers.forward(x, positions, kv_caches, md)
        rope = self.model.rotary.prepare(positions, x.dtype)
        local = self.model.rotary_local
        rope_local = local.prepare(positions, x.dtype) if local is not None else rope
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, rope_local if self.spec.uses_local_rope(i) else rope, kv_cache, md)
        return x + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        return x

    def layer_rope(self, layer: int, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary embedding of layer ``layer`` at ``positions`` (the local table where the family has one)."""
        local = self.model.rotary_local
        table = local if local is not None and self.spec.uses_local_rope(layer) else self.model.rotary
        return table.prepare(positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h, _ = self.model.norm(hidden)
        logits = self.lm_head.compute_logits(h)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- loading -----------------------------------------------------------------------------------
    def _pieces(
        self, name: str, tensor: torch.Tensor, params: Mapping[str, nn.Parameter]
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        """(parameter, part, tensor) of one checkpoint tensor; a tensor that is already fused in the
        checkpoint (Phi-3's qkv_proj, gate_up_proj) is cut into its parts, each sharded by its loader."""
        target, shard = self.map_name(name)
        owner = self.get_submodule(target.rsplit(".", 1)[0]) if target in params and "." in target else None
        if shard is None and isinstance(owner, ColumnParallelLinear) and len(owner.output_sizes) > 1:
            if tensor.shape[0] != sum(owner.output_sizes):
                raise ValueError(f"fused weight {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{sum(owner.output_sizes)}")
            for i, part in enumerate(tensor.split(owner.output_sizes, dim=0)):
                yield target, i, part
        else:
            yield target, shard, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     on_loaded: Callable[[str], None] | None = None) -> None:
        """Load HF-named checkpoint tensors, fusing q/k/v and gate/up and keeping this rank's shard. ``on_loaded``
        is called with a parameter's name once all its parts are in (``cpu.ops.PackAsLoaded``)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: dict[str, set[int | None]] = {}
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            for target, shard, piece in self._pieces(name, tensor, params):
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                param = params[target]
                if shard is None:
                    param.weight_loader(param, piece)
                else:
                    param.weight_loader(param, piece, shard)
                parts = loaded.setdefault(target, set())
                parts.add(shard)
                if on_loaded is not None and (shard is None or len(parts) == self._num_parts(target)):
                    on_loaded(target)
        expected = set(params) - ({"lm_head.weight"} if self.tie_word_embeddings else set())
        missing = expected - loaded.keys()
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")

    def _num_parts(self, target: str) -> int | None:
        """How many parts a fused parameter is loaded in (None: not a fused layer's)."""
        sizes = getattr(self.get_submodule(target.rsplit(".", 1)[0]), "shard_sizes", None) if "." in target else None
        return None if sizes is None else len(sizes)

    def finish_loading(self, fused: Mapping[str, QuantBlocks | SplitBlocks] | None = None,
                       compact: bool = False) -> None:
        """After ``load_weights``: pack the linear weights for this model's ops that are not packed yet (native
        with ``compact``: each in the smallest exact format, from ``fused``, the checkpoint's GGUF blocks by
        parameter, ``fused_quant_blocks``) and bind the one-call layer driver where it applies (native ops, see
        cpu/layers.py)."""
        pack_weights(self, self.ops, fused if compact and self.ops.native else None, compact)
        if self.ops.native and self.ops.kernels is not None:
            self.native_layers = NativeLayers.build(self, self.ops.kernels)

    def fused_quant_blocks(self, blocks: Mapping[str, QuantBlocks]) -> dict[str, QuantBlocks | SplitBlocks]:
        """Checkpoint GGUF blocks (HF names) per parameter of this model, q/k/v and gate/up concatenated
        like their weights (parts of different types in a ``SplitBlocks``). A parameter gets blocks only when
        all its parts have them; none under tensor parallelism (the shards would have to be cut along the
        blocks)."""
        if tp_world_size() > 1:
            return {}
        parts: dict[str, dict[int, QuantBlocks]] = {}
        for name, b in blocks.items():
            target, shard = self.map_name(name)
            parts.setdefault(target, {})[-1 if shard is None else shard] = b  # -1: all of the parameter
        params = dict(self.named_parameters(remove_duplicate=False))
        out: dict[str, QuantBlocks | SplitBlocks] = {}
        for target, by_part in parts.items():
            if target not in params:
                continue
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            n_parts = len(getattr(owner, "shard_sizes", [0]))
            if list(by_part) == [-1]:  # stored fused (Phi-3's qkv and gate_up)
                fused: QuantBlocks | SplitBlocks = by_part[-1]
            elif sorted(by_part) == list(range(n_parts)):
                fused = fuse_blocks([by_part[i] for i in range(n_parts)])
            else:
                continue
            if fused.shape == tuple(params[target].shape):
                out[target] = fused
        return out
