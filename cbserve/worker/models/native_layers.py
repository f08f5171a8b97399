"""A CPU model's decoder layers in one C call a step (``csrc/layers.c``) instead of ~9 Python-dispatched
kernel calls a layer.

The C driver runs the very kernels the modules run, in the same order, so its hidden states equal the module
path's bit for bit (tests/worker/test_cpu_layers.py checks it); it only removes the Python between them:
argument checks, tensor allocation and module dispatch, 5.6-8.5 ms of a 34-112 ms SmolLM2 decode step with
12-64 running requests on the 2-core benchmark machine. Models the driver does not cover keep the module
path, with one log line saying why: tensor parallelism, weights not packed for the C kernels, an attention
backend other than the C one, and families whose layer math is not Llama's (``CausalLM.driver_blocker``:
q/k norms, GeGLU, Gemma's extra norms, soft-capping, mixture-of-experts). Sliding windows are covered (each
layer's window is its own argument of the attention kernel).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch
from torch import nn

from cbserve.worker.attention.backend import AttentionMetadata, KVCache
from cbserve.worker.attention.cpu_backend import CpuAttentionBackend, CpuPrepared
from cbserve.worker.cpu.abi import LayerArgs, LinearArgs, ModelArgs, format_code
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import MANY_ROWS, NativeWeight, RegimeWeight, SplitWeight, native_panels
from cbserve.worker.parallel import tp_world_size

logger = logging.getLogger(__name__)


def _linear_args(module: nn.Module, bias_in_kernel: bool, keep: list[LinearArgs]) -> LinearArgs:
    """The weight's struct; a weight in parts (``SplitWeight``) as a chain: each part's struct points at the next
    part's, which ``keep`` holds (the first is copied into its layer's struct)."""
    bias = 0 if module.bias is None else module.bias.data_ptr()
    rest: LinearArgs | None = None
    rows = 0
    for p in reversed(native_panels(module.packed) or ()):
        rows += p.n
        rest = LinearArgs(format_code(p.fmt), p.data.data_ptr(), rows, p.k, bias, int(bias_in_kernel),
                          p.n if rest is not None else 0, 0 if rest is None else ctypes.addressof(rest))
        keep.append(rest)
    assert rest is not None  # _ineligible checked every weight's packing
    return rest


def _ineligible(model: Any) -> str | None:
    """Why ``model`` cannot use the C layer driver, or None when it can."""
    if tp_world_size() > 1:
        return "tensor parallelism"
    family = model.driver_blocker()
    if family is not None:
        return f"{model.config.model_type} layers have {family}"
    layers = model.model.layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(native_panels(m.packed) is not None for m in linears):
            return "linear weights not packed for the C kernels"
        if not isinstance(attn.attn, CpuAttentionBackend):
            return f"attention backend {attn.attn.name!r}"
        norms = (layer.input_layernorm, layer.post_attention_layernorm,
                 *(n for n in (attn.q_norm, attn.k_norm, *_ff_norms(layer)) if n is not None))
        if any(n.kernels is None or n.eps != layers[0].input_layernorm.eps for n in norms):
            return "norms not on the C kernels"
        if any(b is not None and b.dtype != torch.float32 for m in linears for b in [m.bias]):
            return "non-float32 biases"
        if getattr(mlp.act, "kernels", None) is None:
            return "MLP activation not on the C kernels"
    local = model.model.rotary_local
    if model.model.rotary.kernels is None or (local is not None and local.kernels is None):
        return "rotary embedding not on the C kernels"
    return None


def _ff_norms(layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """Gemma's norms before and after the MLP (None, None for Llama's layer)."""
    return getattr(layer, "pre_feedforward_layernorm", None), getattr(layer, "post_feedforward_layernorm", None)


def rows_prepared(num_tokens: int, md: AttentionMetadata) -> bool:
    """A step whose per-token C attention arguments the backend prepared."""
    p = md.prepared
    return num_tokens > 0 and isinstance(p, CpuPrepared) and p.prefill is None \
        and p.rows.seq_lens.shape[0] == num_tokens


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _addresses(kv_caches: list[KVCache]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for kv in kv_caches for t in kv)


class NativeLayers:
    """The C layer driver bound to one model's packed weights (build with ``NativeLayers.build``)."""

    def __init__(self, model: Any, kernels: CpuKernels) -> None:
        self.kernels = kernels
        layers = model.model.layers
        attn0 = layers[0].self_attn
        rotary = model.model.rotary  # the structs point into the model's tensors, which outlive this driver
        self.args = ModelArgs(
            num_layers=len(layers), hidden=model.config.hidden_size, heads=attn0.num_heads,
            kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim,
            inter=sum(p.n for p in native_panels(layers[0].mlp.gate_up_proj.packed) or ()) // 2, num_blocks=0,
            block_size=0,
            eps=layers[0].input_layernorm.eps, scale=attn0.attn.scale, cos=rotary.cos.data_ptr(),
            sin=rotary.sin.data_ptr(), max_pos=rotary.cos.shape[0],
            act=0 if model.spec.act == "silu" else 1,
        )
        local = model.model.rotary_local
        self.layers = (LayerArgs * len(layers))()
        self._parts: list[LinearArgs] = []  # the structs of weights in parts, which the layers' structs point at
        uses_local = model.spec.uses_local_rope
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            pre, post = _ff_norms(layer)
            self.layers[i] = LayerArgs(
                in_norm=layer.input_layernorm.weight.data_ptr(),
                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=_linear_args(attn.qkv_proj, True, self._parts), o=_linear_args(attn.o_proj, False, self._parts),
                gate_up=_linear_args(mlp.gate_up_proj, True, self._parts),
                down=_linear_args(mlp.down_proj, False, self._parts),
                window=attn.attn.sliding_window or 0,
                q_norm=_ptr(attn.q_norm and attn.q_norm.weight), k_norm=_ptr(attn.k_norm and attn.k_norm.weight),
                pre_ff_norm=_ptr(pre and pre.weight), post_ff_norm=_ptr(post and post.weight),
                softcap=attn.attn.softcap or 0.0,
                cos=_ptr(local.cos if uses_local(i) else None), sin=_ptr(local.sin if uses_local(i) else None),
            )
        self._bound: tuple[int, ...] = ()  # addresses of the KV caches the structs point at (no reference held)
        # steps of this many rows or more run module by module: their products belong on torch's path
        # (the probe found the C kernels slower there, linear.RegimeWeight)
        torch_many = any(isinstance(m.packed, RegimeWeight)
                         and not isinstance(m.packed.many, NativeWeight | SplitWeight)
                         for layer in layers for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
        self.max_rows = MANY_ROWS if torch_many else None

    @classmethod
    def build(cls, model: Any, kernels: CpuKernels) -> NativeLayers | None:
        reason = _ineligible(model)
        if reason is not None:
            logger.info("decoder layers run module by module (no C layer driver: %s)", reason)
            return None
        return cls(model, kernels)

    def applies(self, num_tokens: int, md: AttentionMetadata) -> bool:
        """A step the driver runs: ``rows_prepared``, and where the linear products of many rows run on torch, of
        fewer rows than that."""
        return rows_prepared(num_tokens, md) and (self.max_rows is None or num_tokens < self.max_rows)

    def _bind(self, kv_caches: list[KVCache]) -> None:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        a = self.args
        want = (a.kv_heads, a.head_dim)
        for i, (k, v) in enumerate(kv_caches):
            if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in (k, v)) \
                    or k.shape != v.shape or tuple(k.shape[2:]) != want or k.shape[:2] != kv_caches[0][0].shape[:2]:
                raise ValueError(f"KV cache of layer {i} is not a contiguous float32 [blocks, block_size, {want}] pair")
            self.layers[i].k_cache, self.layers[i].v_cache = k.data_ptr(), v.data_ptr()
        a.num_blocks, a.block_size = kv_caches[0][0].shape[:2]
        self._bound = _addresses(kv_caches)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                md: AttentionMetadata) -> torch.Tensor:
        """All layers over x [n, hidden] (the embeddings, overwritten); returns the final hidden states."""
        if _addresses(kv_caches) != self._bound:  # a new or re-allocated cache: check it and point at it
            self._bind(kv_caches)
        p = md.prepared
        if not isinstance(p, CpuPrepared):
            raise ValueError("the C layer driver needs the CPU attention backend's prepared rows (see applies())")
        d = p.rows
        self.kernels.llama_layers(self.args, self.layers, x, positions, md.slot_mapping, d.block_tables,
                                   d.seq_lens, d.max_seq_len)
        return x

