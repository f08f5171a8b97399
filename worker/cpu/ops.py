"""Which kernels a CPU model runs on (``ModelConfig.cpu_ops``), chosen before the model is built and passed
to its constructor as a ``CpuOps``.

- "native": cbserve's C kernels (``csrc/``, built by ``native.py``) for the linear layers and the LM head
  (panel-packed weights), RMSNorm with the residual add, SiLU-and-mul and rotary embeddings; the attention
  selector also picks the C attention backend for ``attention_backend="auto"``, and then every step runs
  all decoder layers in one C call (``layers.py``). float32 activations, KV cache and norms; with
  ``dtype="bfloat16"`` the linear layers' products are bfloat16 (``CpuOps.bf16_products``, see linear.py).
- "onednn": linear weights packed for oneDNN; torch for everything else.
- "torch": plain torch (``F.linear`` on MKL), the reference the others are tested against.
- "auto": native when the kernels build (float32 or bfloat16), else onednn, else torch.

The modules take ``CpuOps.kernels`` when they are constructed; the weights, which exist only once loaded,
are packed by ``pack_weights`` from the model's own post-load step (``models.causal_lm.CausalLM.finish_loading``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .gguf_blocks import QuantBlocks
from .kernels import CpuKernels
from .linear import pack_linear_weights
from .native import load_cpu_kernels

logger = logging.getLogger(__name__)


class CpuOps(NamedTuple):
    """The kernels a model is built on: ``mode`` ("native" | "onednn" | "torch") and, for native, the loaded
    C kernels (None otherwise), which the norms, activations and rotary embedding are given.
    ``bf16_products`` (native, ``dtype="bfloat16"``): the model is built in float32 and only the linear
    layers' products are bfloat16 (weights rounded once, inputs at each product, float32 sums)."""

    mode: str
    kernels: CpuKernels | None
    bf16_products: bool = False

    @property
    def native(self) -> bool:
        return self.mode == "native"


TORCH_OPS = CpuOps("torch", None)


def resolve_cpu_ops(requested: str, device: torch.device, dtype: torch.dtype) -> CpuOps:
    """The ops to build the model with. ValueError when "native" or "onednn" is asked for explicitly and
    cannot be had. Not a CPU device: torch."""
    if device.type != "cpu":
        return TORCH_OPS
    if requested in ("auto", "native"):
        if dtype not in (torch.float32, torch.bfloat16):
            reason = f"the C kernels run float32 or bfloat16 products, not {dtype}"
        else:
            load = load_cpu_kernels()
            if load.kernels is not None:
                return CpuOps("native", load.kernels, dtype == torch.bfloat16)
            reason = load.reason
        if requested == "native":
            raise ValueError(f"cpu_ops='native' is not available: {reason}")
        logger.warning("CPU C kernels not used (%s); linear layers on oneDNN or torch instead", reason)
    if requested in ("auto", "onednn"):
        if torch.backends.mkldnn.is_available():
            return CpuOps("onednn", None)
        if requested == "onednn":
            raise ValueError("cpu_ops='onednn' is not available: torch was built without oneDNN")
    return TORCH_OPS


def pack_weights(
    model: nn.Module, ops: CpuOps, blocks: Mapping[str, QuantBlocks] | None = None, compact: bool = False
) -> int:
    """Pack the loaded linear weights for ``ops`` (native or onednn; native with ``compact`` keeps exact
    compact formats, from ``blocks`` where given, see linear.py); torch packs nothing. Returns how many."""
    if ops.mode == "torch":
        return 0
    if ops.native and ops.kernels is None:
        raise ValueError("cpu_ops 'native' needs the loaded kernels")
    native = ops.native and ops.kernels is not None
    return pack_linear_weights(model, ops.kernels if native else None, blocks, compact and native,
                               ops.bf16_products)
