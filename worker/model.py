"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2-style q/k/v bias), with GQA, RoPE scaling, tied
embeddings and tensor parallelism, over a flattened, unpadded token batch and a paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .attention.backend import AttentionBackend, AttentionMetadata, KVCache
from .cpu.gguf_blocks import QuantBlocks
from .cpu.kernels import CpuKernels
from .cpu.layers import NativeLayers
from .cpu.ops import TORCH_OPS, CpuOps, pack_weights
from .layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from .model_info import SUPPORTED_MODEL_TYPES, head_dim_of, num_kv_heads_of
from .parallel import divide, tp_world_size
from .rotary import Rope, RotaryEmbedding

logger = logging.getLogger(__name__)

class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, backend_cls: type[AttentionBackend]) -> None:
        super().__init__()
        tp = tp_world_size()
        self.head_dim = head_dim_of(cfg)
        self.num_heads = divide(cfg.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads_of(cfg), tp, "num_key_value_heads")
        qwen2 = cfg.model_type == "qwen2"
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, num_kv_heads_of(cfg), attn_bias or qwen2
        )
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim, cfg.hidden_size, attn_bias and not qwen2
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.attn = backend_cls(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, md: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are rotated together: one set of elementwise ops (or one C pass) instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = rope.apply(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(q, k, v, kv_cache, md)
        return self.o_proj(o.view(n, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.hidden_act!r} is not supported")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias)
        self.act = SiluAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, backend_cls: type[AttentionBackend], kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend_cls)
        self.mlp = LlamaMLP(cfg, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: Any, backend_cls: type[AttentionBackend], max_positions: int, kernels: CpuKernels | None = None
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend_cls, kernels) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.rotary = RotaryEmbedding(cfg, head_dim_of(cfg), max_positions, kernels)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns the final hidden states (before the last norm) of every token;
    ``compute_logits`` takes only the rows to sample.

    ``ops`` (``cpu.ops.resolve_cpu_ops``) chooses the CPU kernels the model is built on: with the native
    ops, the norms, the activation and the rotary embedding run on cbserve's C kernels. After
    ``load_weights``, ``finish_loading`` packs the linear weights for those ops and, where it applies,
    binds the C driver that runs every decoder layer of a step in one call."""

    def __init__(
        self, cfg: Any, backend_cls: type[AttentionBackend], max_positions: int, ops: CpuOps = TORCH_OPS
    ) -> None:
        super().__init__()
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {cfg.model_type!r} is not supported ({SUPPORTED_MODEL_TYPES})"
            )
        self.config = cfg
        self.ops = ops
        self.model = LlamaModel(cfg, backend_cls, max_positions, ops.kernels)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Bound by finish_loading (native ops): runs all decoder layers of a step in one C call.
        self.native_layers: NativeLayers | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.native_layers is not None and self.native_layers.applies(x.shape[0], md):
            return self.native_layers.forward(x, positions, kv_caches, md)
        rope = self.model.rotary.prepare(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, md)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h, _ = self.model.norm(hidden)
        return self.lm_head.compute_logits(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors, fusing q/k/v and gate/up and keeping this rank's shard."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = _map_name(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        expected = set(params) - ({"lm_head.weight"} if self.tie_word_embeddings else set())
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")

    def finish_loading(self, blocks: Mapping[str, QuantBlocks] | None = None, compact: bool = False) -> None:
        """After ``load_weights``: pack the linear weights for this model's ops (native with ``compact``: each
        in the smallest exact format, from the checkpoint's GGUF ``blocks``, HF names, where given) and bind
        the one-call layer driver where it applies (native ops, see cpu/layers.py)."""
        fused = self.fused_quant_blocks(blocks) if blocks and compact and self.ops.native else {}
        pack_weights(self, self.ops, fused, compact)
        if self.ops.native and self.ops.kernels is not None:
            self.native_layers = NativeLayers.build(self, self.ops.kernels)

    def fused_quant_blocks(self, blocks: Mapping[str, QuantBlocks]) -> dict[str, QuantBlocks]:
        """Checkpoint GGUF blocks (HF names) per parameter of this model, q/k/v and gate/up concatenated
        like their weights. A parameter gets blocks only when all its parts have them, of one type; none
        under tensor parallelism (the shards would have to be cut along the blocks)."""
        if tp_world_size() > 1:
            return {}
        parts: dict[str, dict[int, QuantBlocks]] = {}
        for name, b in blocks.items():
            target, shard = _map_name(name)
            parts.setdefault(target, {})[shard or 0] = b
        params = dict(self.named_parameters(remove_duplicate=False))
        out: dict[str, QuantBlocks] = {}
        for target, by_part in parts.items():
            if target not in params:
                continue
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            n_parts = len(getattr(owner, "shard_sizes", [0]))
            qtypes = {b.qtype for b in by_part.values()}
            if sorted(by_part) != list(range(n_parts)) or len(qtypes) != 1:
                continue
            fused = QuantBlocks(qtypes.pop(), torch.cat([by_part[i].raw for i in range(n_parts)]))
            if fused.shape == tuple(params[target].shape):
                out[target] = fused
        return out


# checkpoint projection -> (fused parameter, index of its part: the shard_id of the fused weight_loader)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _map_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            fused, shard = _FUSED[p]
            parts[i] = fused
            return ".".join(parts), shard
    return name, None
