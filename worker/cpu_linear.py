"""Pre-packed CPU weights: linear layers run through oneDNN with weights reordered once at load time.

On CPU, ``F.linear`` goes to the BLAS library torch was built with (MKL), whose kernels for the few-row
products of a decode step leave most of the core idle: on the 2-core AMD EPYC (AVX-512) this project is
benchmarked on, SmolLM2's 576 x 1536 projection runs at 37 GFLOP/s with 8 rows and 62 with 16. oneDNN with
the weight reordered ahead of time into its blocked layout runs the same products at 84 and 135 GFLOP/s,
and large prefill GEMMs at ~200 GFLOP/s against MKL's ~140 (``benchmarks/bench_cpu.py`` measures both).

The packed tensor replaces the dense weight (same number of elements, an opaque oneDNN layout), so memory
does not double. Results equal ``F.linear`` up to fp32 summation order (~1e-4 absolute on unit-scale
inputs). Used for float32 and bfloat16 on CPU when torch has oneDNN; everything else keeps ``F.linear``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Row count oneDNN chooses the blocked layout for; measured flat from 16 to 1024 rows on the bench machine.
PACK_BATCH_HINT = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(weight: torch.Tensor) -> bool:
    """True when ``weight`` can be packed: a 2-D float32/bfloat16 CPU tensor and torch built with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _PACKABLE_DTYPES
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


def pack_module_weight(module: nn.Module, release_dense: bool) -> bool:
    """Set ``module.packed`` to its packed ``weight`` (once) and, with ``release_dense``, free the dense copy;
    returns False, changing nothing, where packing is unsupported."""
    if module.packed is None:
        if not packing_supported(module.weight):
            return False
        module.packed = pack_weight(module.weight)
        if release_dense:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
    return True


@runtime_checkable
class Packable(Protocol):
    def pack(self, release_dense: bool) -> bool: ...


class PackableLinear(nn.Module):
    """Base of the model's linear layers: ``weight`` [out, in], optional ``bias``; after ``pack()`` the
    dense weight is released and ``linear()`` runs on the packed copy."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: torch.Tensor | None = None

    def pack(self, release_dense: bool) -> bool:
        return pack_module_weight(self, release_dense)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.dtype == self.packed.dtype:
            return packed_linear(x, self.packed, bias)
        if self.packed is not None and self.weight.numel() == 0:
            raise RuntimeError(f"packed weight needs 2-D {self.packed.dtype} input, got {x.dtype} {x.dim()}-D")
        return F.linear(x, self.weight, bias)


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every ``Packable`` module of ``model`` (dense copies are released unless the weight is shared,
    like tied embeddings); returns how many were packed."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for m in model.modules():
        if isinstance(m, Packable) and isinstance(m.weight, torch.Tensor):
            packed += m.pack(release_dense=uses[id(m.weight)] == 1)
    if packed:
        logger.info("packed %d CPU linear weights into oneDNN's blocked layout", packed)
    return packed
