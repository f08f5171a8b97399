"""Rotary position embeddings (RoPE) with the config's scaling: default, linear, llama3; other HF types
(yarn, longrope, ...) through transformers' own frequency functions at load time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.layers.basic import use_triton


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Normalise transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters) configs; with
    ``layer_type``, the parameters of that kind of layer where the config has one set per kind (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(hf_config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type", out.get("type", "default")) or "default"
    if out["rope_type"] == "su":  # Phi-3's first name for longrope
        out["rope_type"] = "longrope"
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(
    hf_config: Any, head_dim: int, layer_type: str | None = None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32, on the default device) and the cos/sin scaling factor (of
    ``layer_type``'s rope where the config has one per kind of layer).

    longrope (Phi-3, "su"): the long factors when the served context (``max_positions``) exceeds
    ``original_max_position_embeddings``, else the short ones, for every position. HF instead switches a
    sequence to the long factors once it grows past that length and recomputes its cache then; the two agree
    for every sequence when no sequence can outgrow it (short factors) and for prompts longer than it."""
    p = rope_parameters(hf_config, layer_type)
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    if dim != head_dim:
        raise NotImplementedError("partial rotary embeddings are not supported")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, p), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    params = getattr(hf_config, "rope_parameters", None)
    per_type = isinstance(params, dict) and isinstance(params.get(layer_type), dict)
    kw: dict[str, Any] = {"layer_type": layer_type} if per_type else {}
    if rope_type == "longrope":
        orig = int(p.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
        if max_positions is not None and max_positions > orig:
            kw["seq_len"] = orig + 1
    with torch.device("cpu"):  # transformers makes some tensors on the default device, others on the given one
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kw)
    return inv.float().to(torch.get_default_device()), float(scale)


class Rope(Protocol):
    """This step's rotation: made once per forward by ``RotaryEmbedding.prepare``, applied in every layer."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, num_heads, head_dim]; may work in place (the native one does)."""
        ...


@dataclass(frozen=True)
class TorchRope:
    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, self.cos, self.sin)


@dataclass(frozen=True)
class NativeRope:
    kernels: CpuKernels
    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # the whole [max_positions, head_dim] tables
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        self.kernels.rotary_(x.view(x.shape[0], -1), x.shape[2], self.positions, self.cos, self.sin)
        return x


@dataclass(frozen=True)
class TritonRope:
    """CUDA: one fused Triton kernel (triton_fused.rotary_) over x, in place, with the torch path's rounding."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # the whole [max_positions, head_dim] float32 tables
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        from cbserve.worker.cuda import triton_fused

        return triton_fused.rotary_(x, self.positions, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] (float32); ``prepare(positions)`` once per
    forward. With ``kernels`` (float32 CPU models on the native ops, see cpu/ops.py) the rotation is one C
    pass, in place; on CUDA one Triton kernel, in place (``TritonRope``)."""

    def __init__(
        self, hf_config: Any, head_dim: int, max_positions: int, kernels: CpuKernels | None = None,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, scale = compute_inv_freq(hf_config, head_dim, layer_type, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)
        self.kernels = kernels

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        if self.kernels is not None and dtype == torch.float32:
            return NativeRope(self.kernels, positions, self.cos, self.sin)
        if use_triton(positions, dtype):
            return TritonRope(positions, self.cos, self.sin)
        cos, sin = self.cos_sin(positions, dtype)
        return TorchRope(cos, sin)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] tables for the given positions (broadcast over heads)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
