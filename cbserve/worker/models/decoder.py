"""The shared decoder every family is built from: attention (fused q/k/v, optional per-head q/k norms, a
per-layer sliding window and logit soft-cap, rotary embeddings), the gated MLP, the norms, one decoder layer
and the stack. ``DecoderSpec`` says how a family departs from the Llama baseline; a family module turns its
``config.json`` into one (see ``llama.py``, ``qwen3.py``, ``gemma2.py``, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cbserve.worker.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from cbserve.worker.attention.cpu_backend import CpuAttentionBackend
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.layers.basic import (
    ColumnParallelLinear,
    GeluTanhAndMul,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from cbserve.worker.layers.rotary import Rope, RotaryEmbedding
from cbserve.worker.parallel import divide, tp_world_size
from cbserve.worker.shapes import head_dim_of, num_kv_heads_of

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class DecoderSpec:
    """How a family's decoder differs from Llama's (every default is Llama's)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before the rotary embedding
    gemma_norms: bool = False  # (1 + w) RMSNorms, product in float32
    sandwich_norms: bool = False  # norms after attention and before and after the MLP (Gemma 2/3)
    embed_scale: float | None = None  # the embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(s / cap)
    final_softcap: float | None = None  # the LM head's logits -> cap * tanh(s / cap)
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window (None: global); () = none anywhere
    local_rope: tuple[bool, ...] = ()  # per layer: True = the "sliding_attention" rope (Gemma 3's local base)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def uses_local_rope(self, layer: int) -> bool:
        return bool(self.local_rope) and self.local_rope[layer]

    def driver_blocker(self) -> str | None:
        """Why the one-call C layer driver (cpu/layers.py) cannot run these layers: it runs Llama's layer and
        every departure above (q/k norms, GeGLU, Gemma's norms, soft-capping, windows, a local rope), so
        nothing here stops it; a family adding one it lacks says so."""
        return None


def layer_windows(cfg: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window as HF applies it: ``sliding_window`` on the layers ``layer_types`` marks
    "sliding_attention", or on every layer when the config has no ``layer_types`` (Mistral, Phi-3)."""
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    types: Sequence[str] | None = getattr(cfg, "layer_types", None)
    if not window:
        return (None,) * n
    if types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * n


def activation_of(cfg: Any) -> str:
    name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"hidden activation {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class Attention(nn.Module):
    def __init__(
        self, cfg: Any, spec: DecoderSpec, layer: int, backend_cls: type[AttentionBackend],
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        tp = tp_world_size()
        self.head_dim = head_dim_of(cfg)
        self.num_heads = divide(cfg.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads_of(cfg), tp, "num_key_value_heads")
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_attention_heads, num_kv_heads_of(cfg), spec.qkv_bias
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, spec.o_bias)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.q_norm = self.k_norm = None
        if spec.qk_norm:  # per head: the same weight for every head, no tensor-parallel split
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels, spec.gemma_norms)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels, spec.gemma_norms)
        scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim**-0.5
        # the C attention runs on the model's own build of the kernels (its cpu_isa)
        own = {"kernels": kernels} if kernels is not None and issubclass(backend_cls, CpuAttentionBackend) else {}
        self.attn = backend_cls(self.num_heads, self.num_kv_heads, self.head_dim, scale, spec.window(layer),
                                spec.attn_softcap, **own)

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention's result ``[tokens, heads, head_dim]``."""
        return self.o_proj(o.reshape(o.shape[0], self.q_size))

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed per head where the family does, rotated) and v of ``x``: what the attention reads."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is None or self.k_norm is None:
            # q and k are rotated together: one set of elementwise ops (or one C pass) instead of two.
            qk = qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = rope.apply(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = self.q_norm.norm_heads(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm.norm_heads(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
            )
            q, k = rope.apply(q.contiguous()), rope.apply(k.contiguous())
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        return q, k, v


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one column-parallel projection."""

    def __init__(self, cfg: Any, spec: DecoderSpec, kernels: CpuKernels | None = None) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, spec.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, spec.mlp_bias)
        self.act = SiluAndMul(kernels) if spec.act == "silu" else GeluTanhAndMul(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """One layer. The residual stream is carried apart from the layer's output (``residual``) so that each
    norm can fuse the residual add (one C pass on the native ops)."""

    def __init__(
        self, cfg: Any, spec: DecoderSpec, layer: int, backend_cls: type[AttentionBackend], mlp: nn.Module,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        hidden, eps, gemma = cfg.hidden_size, cfg.rms_norm_eps, spec.gemma_norms
        self.self_attn = Attention(cfg, spec, layer, backend_cls, kernels)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, kernels, gemma)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels, gemma)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, kernels, gemma)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, kernels, gemma)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: KVCache, md: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, residual = self.before_attention(x, residual, rope)
        return self.after_attention(self.self_attn.attn.forward(q, k, v, kv_cache, md), residual)

    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to its attention: (q, k, v, residual). With ``after_attention``, the two halves that
        piecewise CUDA graphs capture on either side of the attention (piecewise_graphs.py)."""
        h, residual = self.input_layernorm(x, residual)
        q, k, v = self.self_attn.qkv(h, rope)
        return q, k, v, residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's result ``o`` ``[tokens, heads, head_dim]`` on: (output, residual)."""
        h = self.self_attn.project(o)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        # Gemma: the attention output is normed before it joins the residual stream, the MLP's likewise.
        h, _ = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers, the final norm and the rotary tables (``rotary_local``: the second
    table of the layers ``spec.local_rope`` marks, None when there is none)."""

    def __init__(
        self, cfg: Any, spec: DecoderSpec, layers: list[DecoderLayer], max_positions: int,
        kernels: CpuKernels | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, spec.gemma_norms)
        # layer types name a rope only where the config has one per type (Gemma 3); others ignore them
        self.rotary = RotaryEmbedding(cfg, head_dim_of(cfg), max_positions, kernels, "full_attention")
        self.rotary_local = (
            RotaryEmbedding(cfg, head_dim_of(cfg), max_positions, kernels, "sliding_attention")
            if any(spec.local_rope) else None
        )
