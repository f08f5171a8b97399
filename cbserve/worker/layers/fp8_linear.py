"""``quantization="fp8"`` (vLLM's online FP8): the linear layers of a bf16/fp16/fp32 checkpoint quantized to FP8 e4m3
once they are loaded, with one float32 scale per output channel, multiplying activations quantized per token at
each step (dynamic scales, ``fp8.quantize_rows``' formula).

Each ``ColumnParallelLinear`` / ``RowParallelLinear`` (q/k/v, o, gate/up, down: this rank's shard) gets an
``Fp8Weight`` as its packed weight (the hook ``cpu/linear.py``'s ``PackableLinear.linear`` already runs for packed
weights) and its dense weight is released. The embeddings, the LM head and the norms stay in the model's dtype.

- CUDA (compute capability 8.9+): the input is quantized by one Triton kernel (``cuda/fp8_quant.py``) and
  ``torch._scaled_mm`` multiplies on the FP8 tensor cores with row-wise scales (the token's and the channel's),
  accumulating in float32 and writing bfloat16; a bias is added after. It needs both matrix sizes of every layer
  to be multiples of 16; a model whose layers are not is refused at load.
- CPU: an emulation for accuracy checks: the same e4m3 values and scales, multiplied in float32
  (``(x_q @ w_q^T) * s_x * s_w``, the products ``_scaled_mm`` sums).

Mixture-of-experts blocks are not covered: such a model is refused rather than half quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from cbserve.worker.fp8 import FP8_DTYPE, quantize_rows
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear
from cbserve.worker.layers.moe import SparseMoeBlock

logger = logging.getLogger(__name__)

SCALED_MM_ALIGN = 16  # torch._scaled_mm's requirement on both sizes of the weight


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight in e4m3 [out, in] with its float32 scales [1, out]; ``matmul`` is ``F.linear`` of the
    dequantized weight and the per-token quantized input. ``dtype``: the activations' (the model's)."""

    weight: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(weight.detach())
        return cls(q.contiguous(), scale.reshape(1, -1).contiguous(), weight.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = _scaled_mm_cuda(x, self) if x.is_cuda else _scaled_mm_emulated(x, self)
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return (self.weight.float() * self.scale.t()).to(self.dtype)


def _scaled_mm_cuda(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    from cbserve.worker.cuda.fp8_quant import quantize_tokens

    xq, xs = quantize_tokens(x.contiguous())
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale, out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def _scaled_mm_emulated(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """What ``_scaled_mm`` computes, in float32: exact e4m3 products, float32 sums, then both scales."""
    xq, xs = quantize_rows(x)
    return ((xq.float() @ w.weight.float().t()) * xs * w.scale).to(x.dtype)


def fp8_linear_layers(model: nn.Module) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    """The layers ``quantization="fp8"`` quantizes; ValueError for a model with mixture-of-experts blocks."""
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        raise ValueError(
            "quantization 'fp8' covers dense models: this model's mixture-of-experts blocks would stay "
            "unquantized (leave quantization unset)"
        )
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def quantize_linear_weights(model: nn.Module) -> int:
    """Quantize every linear layer of ``model`` (loaded, not yet packed) to FP8 and release the dense weights;
    returns how many. On CUDA, ValueError for a layer ``_scaled_mm`` cannot multiply and when this device's torch
    cannot run a row-wise scaled FP8 matmul at all."""
    layers = fp8_linear_layers(model)
    dense = quantized = 0
    for name, layer in layers:
        w = layer.weight
        if w.is_cuda and any(n % SCALED_MM_ALIGN for n in w.shape):
            raise ValueError(
                f"quantization 'fp8': layer {name} is {tuple(w.shape)}; FP8 matmuls need both sizes to "
                f"be multiples of {SCALED_MM_ALIGN}"
            )
        layer.packed = Fp8Weight.quantize(w)
        dense += w.numel() * w.element_size()
        quantized += layer.packed.weight.numel() + 4 * layer.packed.scale.numel()
        w.data = torch.empty(0, dtype=w.dtype, device=w.device)
    if layers and layers[0][1].packed.weight.is_cuda:
        probe_scaled_mm(layers[0][1].packed.weight.device)
    logger.info(
        "quantization fp8: %d linear layers in e4m3, %.0f MiB (%.0f MiB before)",
        len(layers),
        quantized / 2**20,
        dense / 2**20,
    )
    return len(layers)


def probe_scaled_mm(device: torch.device) -> None:
    """One tiny row-wise scaled FP8 matmul on ``device``; ValueError saying why when torch refuses it."""
    a = torch.ones(SCALED_MM_ALIGN, SCALED_MM_ALIGN, device=device).to(FP8_DTYPE)
    ones = torch.ones(SCALED_MM_ALIGN, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        raise ValueError(
            f"quantization 'fp8': torch {torch.__version__} cannot run row-wise scaled FP8 matmuls on "
            f"{torch.cuda.get_device_name(device)}: {e}"
        ) from e
