"""Which kernels a CPU model runs on (``ModelConfig.cpu_ops``), and switching them on after the weights load.

- "native": cbserve's C kernels (``csrc/``, built by ``cpu_native.py``) for the linear layers and the LM
  head (panel-packed weights), RMSNorm with the residual add, SiLU-and-mul and rotary embeddings; the
  attention selector also picks the C attention backend for ``attention_backend="auto"``, and then every
  step runs all decoder layers in one C call (``cpu_layers.py``). float32 only.
- "onednn": linear weights packed for oneDNN; torch for everything else.
- "torch": plain torch (``F.linear`` on MKL), the reference the others are tested against.
- "auto": native when the kernels build and the model is float32, else onednn, else torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from .cpu_kernels import CpuKernels
from .cpu_layers import NativeLayers
from .cpu_linear import pack_linear_weights
from .cpu_native import load_cpu_kernels
from .gguf_blocks import QuantBlocks
from .layers import RMSNorm, SiluAndMul
from .rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

_NATIVE_MODULES = (RMSNorm, SiluAndMul, RotaryEmbedding)


def resolve_cpu_ops(requested: str, device: torch.device, dtype: torch.dtype) -> tuple[str, CpuKernels | None]:
    """The mode to use ("native" | "onednn" | "torch") and, for native, the loaded kernels. ValueError when
    "native" or "onednn" is asked for explicitly and cannot be had. Not a CPU device: ("torch", None)."""
    if device.type != "cpu":
        return "torch", None
    if requested in ("auto", "native"):
        if dtype != torch.float32:
            reason = f"the C kernels are float32 only (dtype {dtype})"
        else:
            load = load_cpu_kernels()
            if load.kernels is not None:
                return "native", load.kernels
            reason = load.reason
        if requested == "native":
            raise ValueError(f"cpu_ops='native' is not available: {reason}")
        logger.warning("CPU C kernels not used (%s); linear layers on oneDNN or torch instead", reason)
    if requested in ("auto", "onednn"):
        if torch.backends.mkldnn.is_available():
            return "onednn", None
        if requested == "onednn":
            raise ValueError("cpu_ops='onednn' is not available: torch was built without oneDNN")
    return "torch", None


def enable_cpu_ops(
    model: nn.Module,
    mode: str,
    kernels: CpuKernels | None,
    blocks: Mapping[str, QuantBlocks] | None = None,
    compact: bool = False,
) -> None:
    """Pack the linear weights (native or onednn; native with ``compact`` keeps exact compact formats, from
    ``blocks`` where given, see cpu_linear.py) and point the norms, activations and rotary embedding at the C
    kernels (native)."""
    if mode == "torch":
        return
    if mode == "native" and kernels is None:
        raise ValueError("cpu_ops 'native' needs the loaded kernels")
    native = mode == "native"
    pack_linear_weights(model, kernels if native else None, blocks, compact)  # onednn ignores blocks, compact
    if native:
        for module in model.modules():
            if isinstance(module, _NATIVE_MODULES):
                module.kernels = kernels
        if hasattr(model, "native_layers"):
            model.native_layers = NativeLayers.build(model, kernels)
