"""Pre-packed CPU weights: each linear layer's weight (and the LM head's) is reordered once at load time
into the layout a fast kernel reads, and the dense copy is released so memory does not double.

Two packings, chosen by ``ModelConfig.cpu_ops`` (see ``ops.py``):

- ``"native"``: cbserve's own C kernel (``csrc/gemm.c``) over 48-column panels. A decode step multiplies
  every weight by only a few rows, so its cost is reading the weights; the panel kernel streams each
  weight once, in order. With ``compact`` (``ModelConfig.cpu_compact_weights``, on by default) a weight
  whose float32 values fit a smaller format exactly is stored in it: the GGUF Q8_0 / Q4_x / Q5_0 / Q4_K / Q5_K / Q6_K
  blocks it was dequantized from (``gguf_blocks.py``), or bfloat16 when every value is one. The kernel decodes them to
  the same float32 values in registers, so the arithmetic and the results do not change (each packing is
  checked against the weight it replaces) while 2-7x fewer bytes are read per step (the GGUF blocks as many
  bytes as in the file: float16 scales and packed values).
  With ``bf16_products`` (``dtype="bfloat16"`` on the native ops) every weight is instead rounded to
  bfloat16 and stored in k pairs (GGUF blocks, with ``compact``, stay blocks and are rounded as the kernel
  decodes them; the K-quants and Q5_0 keep their float32 products), and the kernel rounds its input rows to bfloat16
  too and sums the products in float32 with
  AVX-512 BF16 (``vdpbf16ps``: twice float32's multiply rate), or from 4 rows up on Intel AMX tiles where
  the CPU has them (``csrc/amx.c``: 5-7x the AVX-512 rate at 16-2048 rows): not the float32 result, but
  within float32 rounding of the same product computed on bfloat16-rounded operands.
- ``"onednn"``: oneDNN's blocked layout through ``mkldnn._linear_pointwise`` (float32 and bfloat16), for
  machines where the C kernels cannot be built. Still 2-3x MKL's ``F.linear`` for decode-sized products.
- both, by row count (``RegimeWeight``), where ``cpu_ops="auto"``'s probe found the C kernels faster in one
  regime and torch in the other (``probe.py``): products of fewer than ``MANY_ROWS`` rows on one packing, the
  others on the other. The weight is then held twice (its compact panels and torch's copy of its values).

Results equal ``F.linear`` up to float32 summation order (~1e-4 absolute on unit-scale inputs).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from cbserve.worker.cpu.gguf_blocks import QuantBlocks, SplitBlocks
from cbserve.worker.cpu.kernels import CpuKernels, Panels, is_bfloat16_exact
from cbserve.worker.cpu.panels import FLOAT32_BLOCK_FORMATS

logger = logging.getLogger(__name__)

# Row count oneDNN chooses the blocked layout for; measured flat from 16 to 1024 rows on the bench machine.
PACK_BATCH_HINT = 64
# Products of this many rows or more are "many-row" products (prefill chunks) for RegimeWeight and the probe;
# fewer, "few-row" ones (decode steps).
MANY_ROWS = 128
PATHS_NATIVE = ("native", "native")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(weight: torch.Tensor) -> bool:
    """True when oneDNN can pack ``weight``: a 2-D float32/bfloat16 CPU tensor and torch built with oneDNN
    (bfloat16 only on a CPU whose instructions oneDNN's bf16 path needs, e.g. AVX-512 BW)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (weight.dtype != torch.bfloat16 or onednn_bf16_supported())
    )


def onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bfloat16 kernels (they need AVX-512 BW or AVX-NE-CONVERT)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    panels: Panels
    kernels: CpuKernels
    dtype: torch.dtype = torch.float32

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.linear(x, self.panels, bias)


@dataclass(frozen=True)
class DenseWeight:
    """torch's plain ``F.linear`` of a dense weight (where oneDNN cannot pack it)."""

    weight: torch.Tensor
    dtype: torch.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


@dataclass(frozen=True)
class RegimeWeight:
    """One weight on two paths: products of fewer than ``many_rows`` rows on ``few``, the others on ``many``
    (each given its input, bias and result in its own dtype; the model's are float32)."""

    few: PackedWeight
    many: PackedWeight
    many_rows: int = MANY_ROWS
    dtype: torch.dtype = torch.float32

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        part = self.many if x.shape[0] >= self.many_rows else self.few
        if part.dtype == x.dtype:
            return part.matmul(x, bias)
        out = part.matmul(x.to(part.dtype), None if bias is None else bias.to(part.dtype))
        return out.to(x.dtype)


def torch_weight(weight: torch.Tensor, bf16_products: bool) -> PackedWeight:
    """torch's product of the float32 ``weight`` (rounded to bfloat16 for bfloat16 products): oneDNN's packed
    copy where it applies, else ``F.linear`` on a copy."""
    w = weight.detach().to(torch.bfloat16 if bf16_products else torch.float32)
    if packing_supported(w):
        return OneDnnWeight(pack_weight(w), w.dtype)
    return DenseWeight(w, w.dtype)  # the module's dense weight, or its bfloat16 copy


@dataclass(frozen=True)
class SplitWeight:
    """One weight packed for the C kernels in row ranges of different formats (a fused q/k/v whose GGUF parts are
    of different block types): each range's product into its own columns of the result."""

    parts: tuple[NativeWeight, ...]
    dtype: torch.dtype = torch.float32

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out, row = [], 0
        for part in self.parts:
            n = part.panels.n
            out.append(part.matmul(x, None if bias is None else bias[row : row + n]))
            row += n
        return torch.cat(out, dim=1)


WeightBlocks = QuantBlocks | SplitBlocks


def native_weight(packed: PackedWeight | None) -> NativeWeight | None:
    """The C kernels' packing that few-row products of ``packed`` run on, or None when they run on torch (or in
    parts: ``native_panels``)."""
    if isinstance(packed, RegimeWeight):
        packed = packed.few
    return packed if isinstance(packed, NativeWeight) else None


def native_panels(packed: PackedWeight | None) -> tuple[Panels, ...] | None:
    """The panels of the C kernels' packing that few-row products of ``packed`` run on, in row order (one, or a
    ``SplitWeight``'s parts), or None when they run on torch."""
    if isinstance(packed, RegimeWeight):
        packed = packed.few
    if isinstance(packed, SplitWeight):
        return tuple(p.panels for p in packed.parts)
    return (packed.panels,) if isinstance(packed, NativeWeight) else None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float32 values, NaN nowhere. Bit for bit but for the sign of zeros: Q4_0 stores d * (q - 8) (Q6_K
    d * (q - 32)), which gguf-py gives as -0 for q = 8 and a negative d, and the kernel as d * q - 8d = +0."""
    return a.shape == b.shape and torch.equal(a, b) and not bool(torch.isnan(a).any())


def block_panels(weight: torch.Tensor, kernels: CpuKernels, blocks: QuantBlocks | None) -> Panels | None:
    """``weight``'s GGUF blocks packed for the kernel, when given and they reproduce its values; else None."""
    if blocks is None:
        return None
    try:
        packed = kernels.pack_blocks(blocks)
    except ValueError as e:
        packed = None
        logger.warning("GGUF %s blocks of a %s weight cannot be packed (%s)", blocks.qtype, tuple(weight.shape), e)
    if packed is not None and _same_values(kernels.unpack(packed), weight):
        return packed
    logger.warning("GGUF %s blocks do not reproduce a %s weight exactly; it is packed from its float32 values",
                   blocks.qtype, tuple(weight.shape))
    return None


def compact_panels(weight: torch.Tensor, kernels: CpuKernels, blocks: QuantBlocks | None) -> Panels | None:
    """``weight`` packed in a format smaller than float32 that holds its values exactly: its GGUF blocks
    (when given and they reproduce its values) or bfloat16; None when neither does."""
    packed = block_panels(weight, kernels, blocks)
    if packed is None and is_bfloat16_exact(weight):
        packed = kernels.pack_weight(weight, "bf16")
    return packed


def split_panels(w: torch.Tensor, kernels: CpuKernels, blocks: SplitBlocks, bf16_products: bool) -> SplitWeight | None:
    """``w`` packed range by range from its blocks' parts (for bfloat16 products where a part's format has them),
    when every part reproduces its rows; else None."""
    parts, row = [], 0
    for b in blocks.parts:
        panels = block_panels(w[row : row + b.shape[0]].contiguous(), kernels, b)
        if panels is None:
            return None
        if bf16_products and panels.fmt not in FLOAT32_BLOCK_FORMATS:
            panels = kernels.with_bf16_products(panels)
        parts.append(NativeWeight(panels, kernels))
        row += b.shape[0]
    return SplitWeight(tuple(parts))


def make_packed_weight(
    weight: torch.Tensor,
    kernels: CpuKernels | None,
    blocks: WeightBlocks | None = None,
    compact: bool = False,
    bf16_products: bool = False,
    paths: tuple[str, str] = PATHS_NATIVE,
) -> PackedWeight | None:
    """The weight packed for the C kernels (float32, when ``kernels`` is given; with ``compact`` in the
    smallest exact format; with ``bf16_products`` rounded to bfloat16 for bfloat16 products) or else for
    oneDNN; None where neither applies. ``paths`` (with ``kernels``): "native" or "torch" for few-row and
    many-row products; a mixed pair gives a ``RegimeWeight`` of the native packing and torch's."""
    if kernels is not None and weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2:
        native = _native_packing(weight.detach(), kernels, blocks, compact, bf16_products)
        if paths == PATHS_NATIVE:
            return native
        other = torch_weight(weight, bf16_products)
        few, many = (native if p == "native" else other for p in paths)
        return RegimeWeight(few, many)
    if packing_supported(weight):
        return OneDnnWeight(pack_weight(weight), weight.dtype)
    return None


def _native_packing(w: torch.Tensor, kernels: CpuKernels, blocks: WeightBlocks | None, compact: bool,
                    bf16_products: bool) -> NativeWeight | SplitWeight:
    if isinstance(blocks, SplitBlocks):
        split = split_panels(w, kernels, blocks, bf16_products) if compact else None
        if split is not None:
            return split
        blocks = None
    float32_only = blocks is not None and blocks.qtype.lower() in FLOAT32_BLOCK_FORMATS  # in fewer bytes than bf16
    if bf16_products and not float32_only:  # GGUF blocks stay compact (rounded as decoded), the rest rounded once here
        blocks_packed = block_panels(w, kernels, blocks) if compact else None
        panels = kernels.with_bf16_products(blocks_packed) if blocks_packed else kernels.pack_weight(w, "bf16_dot")
        return NativeWeight(panels, kernels)
    return NativeWeight((compact_panels(w, kernels, blocks) if compact else None) or kernels.pack_weight(w), kernels)


def pack_module_weight(
    module: nn.Module,
    release_dense: bool,
    kernels: CpuKernels | None = None,
    blocks: WeightBlocks | None = None,
    compact: bool = False,
    bf16_products: bool = False,
    paths: tuple[str, str] = PATHS_NATIVE,
) -> bool:
    """Set ``module.packed`` to its packed ``weight`` (once) and, with ``release_dense``, free the dense copy;
    returns False, changing nothing, where packing is unsupported."""
    if module.packed is None:
        packed = make_packed_weight(module.weight, kernels, blocks, compact, bf16_products, paths)
        if packed is None:
            return False
        module.packed = packed
        if release_dense:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
    return True


@runtime_checkable
class Packable(Protocol):
    def pack(
        self,
        release_dense: bool,
        kernels: CpuKernels | None = None,
        blocks: WeightBlocks | None = None,
        compact: bool = False,
        bf16_products: bool = False,
        paths: tuple[str, str] = PATHS_NATIVE,
    ) -> bool: ...


class PackableLinear(nn.Module):
    """Base of the model's linear layers: ``weight`` [out, in], optional ``bias``; after ``pack()`` the
    dense weight is released and ``linear()`` runs on the packed copy."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self) -> None:
        super().__init__()
        self.packed: PackedWeight | None = None

    def pack(
        self,
        release_dense: bool,
        kernels: CpuKernels | None = None,
        blocks: WeightBlocks | None = None,
        compact: bool = False,
        bf16_products: bool = False,
        paths: tuple[str, str] = PATHS_NATIVE,
    ) -> bool:
        return pack_module_weight(self, release_dense, kernels, blocks, compact, bf16_products, paths)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.dtype == self.packed.dtype:
            return self.packed.matmul(x, bias)
        if self.packed is not None and self.weight.numel() == 0:
            raise RuntimeError(f"packed weight needs 2-D {self.packed.dtype} input, got {x.dtype} {x.dim()}-D")
        return F.linear(x, self.weight, bias)


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of ``model``, by the parameter's id (a shared one, such as tied embeddings, has
    two)."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return names


def pack_linear_weights(
    model: nn.Module,
    kernels: CpuKernels | None = None,
    blocks: Mapping[str, WeightBlocks] | None = None,
    compact: bool = False,
    bf16_products: bool = False,
    paths: tuple[str, str] = PATHS_NATIVE,
) -> int:
    """Pack every ``Packable`` module of ``model`` for the C kernels (when ``kernels`` is given; with
    ``compact``, each weight in the smallest format that holds it exactly, from ``blocks`` (parameter name ->
    its GGUF blocks) where given; with ``bf16_products`` rounded to bfloat16; with mixed ``paths``, torch's
    copy too for the regime it runs) or for oneDNN. Dense copies are released unless the weight is shared,
    like tied embeddings. Returns how many were packed."""
    names = parameter_names(model)
    blocks = blocks or {}
    packed = 0
    for m in model.modules():
        if isinstance(m, Packable) and isinstance(m.weight, torch.Tensor):
            source = next((blocks[n] for n in names[id(m.weight)] if n in blocks), None)
            packed += m.pack(len(names[id(m.weight)]) == 1, kernels, source, compact, bf16_products, paths)
    if any(getattr(m, "packed", None) is not None for m in model.modules()):  # here or as loaded (ops.PackAsLoaded)
        _log_packing(model, kernels is not None, paths)
    return packed


def _log_packing(model: nn.Module, native: bool, paths: tuple[str, str]) -> None:
    if not native:
        logger.info("packed the CPU linear weights into oneDNN's blocked layout")
        return
    packed = [getattr(m, "packed", None) for m in model.modules()]
    if paths != PATHS_NATIVE:
        logger.warning("CPU linear weights held twice (cbserve's panels and torch's copy): products of fewer than %d "
                       "rows on %s, the others on %s", MANY_ROWS, *paths)
    tops = [p.few if isinstance(p, RegimeWeight) else p for p in packed]
    tops += [p.many for p in packed if isinstance(p, RegimeWeight)]
    weights = [w for t in tops for w in (t.parts if isinstance(t, SplitWeight) else (t,))
               if isinstance(w, NativeWeight)]
    formats = Counter(w.panels.fmt for w in weights)
    stored = sum(w.panels.nbytes for w in weights) / 2**20
    dense = sum(4 * w.panels.n * w.panels.k for w in weights) / 2**20
    logger.info("packed %d CPU linear weights into cbserve's panels (%s): %.0f MiB, %.0f MiB as float32",
                len(weights), ", ".join(f"{n} {f}" for f, n in formats.most_common()), stored, dense)
