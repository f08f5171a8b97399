"""Pre-packed CPU weights: each linear layer's weight (and the LM head's) is reordered once at load time
into the layout a fast kernel reads, and the dense copy is released so memory does not double.

Two packings, chosen by ``ModelConfig.cpu_ops`` (see ``cpu_ops.py``):

- ``"native"``: cbserve's own C kernel (``csrc/gemm.c``) over 48-column panels. A decode step multiplies
  every weight by only a few rows, so its cost is reading the weights; the panel kernel streams each
  weight once, in order. On the 2-core AMD EPYC (Zen 4) this project is benchmarked on, all of
  SmolLM2-135M's weights against 8 / 16 / 32 / 64 rows ran at 1.8 / 1.3 / 1.24 / 1.46x oneDNN's packed
  rate (``benchmarks/bench_cpu.py`` prints the rates; BENCHMARKS.md has the run).
- ``"onednn"``: oneDNN's blocked layout through ``mkldnn._linear_pointwise`` (float32 and bfloat16), for
  machines where the C kernels cannot be built. Still 2-3x MKL's ``F.linear`` for decode-sized products.

Results equal ``F.linear`` up to float32 summation order (~1e-4 absolute on unit-scale inputs).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)

# Row count oneDNN chooses the blocked layout for; measured flat from 16 to 1024 rows on the bench machine.
PACK_BATCH_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(weight: torch.Tensor) -> bool:
    """True when oneDNN can pack ``weight``: a 2-D float32/bfloat16 CPU tensor and torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight reordered into oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    if not packing_supported(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for 2-D ``x`` with ``W`` given as ``pack_weight(W)``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedWeight(Protocol):
    dtype: torch.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` for 2-D ``x`` of ``dtype``."""
        ...


@dataclass(frozen=True)
class OneDnnWeight:
    packed: torch.Tensor
    dtype: torch.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(x, self.packed, bias)


@dataclass(frozen=True)
class NativeWeight:
    panels: torch.Tensor
    out_features: int
    kernels: CpuKernels
    dtype: torch.dtype = torch.float32

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.linear(x, self.panels, self.out_features, bias)


def make_packed_weight(weight: torch.Tensor, kernels: CpuKernels | None) -> PackedWeight | None:
    """The weight packed for the C kernels (float32, when ``kernels`` is given) or else for oneDNN; None
    where neither applies."""
    if kernels is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2:
        return NativeWeight(kernels.pack_weight(weight.detach()), weight.shape[0], kernels)
    if packing_supported(weight):
        return OneDnnWeight(pack_weight(weight), weight.dtype)
    return None


def pack_module_weight(module: nn.Module, release_dense: bool, kernels: CpuKernels | None = None) -> bool:
    """Set ``module.packed`` to its packed ``weight`` (once) and, with ``release_dense``, free the dense copy;
    returns False, changing nothing, where packing is unsupported."""
    if module.packed is None:
        packed = make_packed_weight(module.weight, kernels)
        if packed is None:
            return False
        module.packed = packed
        if release_dense:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
    return True


@runtime_checkable
class Packable(Protocol):
    def pack(self, release_dense: bool, kernels: CpuKernels | None = None) -> bool: ...


class PackableLinear(nn.Module):
    """Base of the model's linear layers: ``weight`` [out, in], optional ``bias``; after ``pack()`` the
    dense weight is released and ``linear()`` runs on the packed copy."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: PackedWeight | None = None

    def pack(self, release_dense: bool, kernels: CpuKernels | None = None) -> bool:
        return pack_module_weight(self, release_dense, kernels)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.dtype == self.packed.dtype:
            return self.packed.matmul(x, bias)
        if self.packed is not None and self.weight.numel() == 0:
            raise RuntimeError(f"packed weight needs 2-D {self.packed.dtype} input, got {x.dtype} {x.dim()}-D")
        return F.linear(x, self.weight, bias)


def pack_linear_weights(model: nn.Module, kernels: CpuKernels | None = None) -> int:
    """Pack every ``Packable`` module of ``model`` for the C kernels (when ``kernels`` is given) or oneDNN;
    dense copies are released unless the weight is shared, like tied embeddings. Returns how many were
    packed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for m in model.modules():
        if isinstance(m, Packable) and isinstance(m.weight, torch.Tensor):
            packed += m.pack(release_dense=uses[id(m.weight)] == 1, kernels=kernels)
    if packed:
        layout = "cbserve's panel layout" if kernels is not None else "oneDNN's blocked layout"
        logger.info("packed %d CPU linear weights into %s", packed, layout)
    return packed
