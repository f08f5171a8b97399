"""Which kernels a CPU model runs on (``ModelConfig.cpu_ops``), chosen before the model is built and passed
to its constructor as a ``CpuOps``.

- "native": cbserve's C kernels (``csrc/``, built by ``native.py``) for the linear layers and the LM head
  (panel-packed weights), RMSNorm with the residual add, SiLU-and-mul and rotary embeddings; the attention
  selector also picks the C attention backend for ``attention_backend="auto"``, and then every step runs
  all decoder layers in one C call (``layers.py``). float32 activations, KV cache and norms; with
  ``dtype="bfloat16"`` the linear layers' products are bfloat16 (``CpuOps.bf16_products``, see linear.py).
- "onednn": linear weights packed for oneDNN; torch for everything else.
- "torch": plain torch (``F.linear`` on MKL), the reference the others are tested against.
- "auto": native when the kernels build (float32 or bfloat16); given the model's shapes and weight format, the
  start-up probe (``probe.py``) then decides few-row (decode) and many-row (prefill) products apart: the C
  kernels where they were no slower than torch's products, torch (oneDNN, else plain) where they were. Both
  regimes on torch: onednn (else torch) for everything; one of each: native, with each linear weight held for
  both paths (``linear.RegimeWeight``).

``isa`` picks the kernels' build (``native.py``: "avx512", "avx2", "scalar"; "auto" the CPU's best).

The modules take ``CpuOps.kernels`` when they are constructed; the weights, which exist only once loaded,
are packed by ``pack_weights`` from the model's own post-load step (``models.causal_lm.CausalLM.finish_loading``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from cbserve.worker.cpu.abi import FORMAT_FLAGS, INT16_ROWS_FORMATS
from cbserve.worker.cpu.gguf_blocks import QuantBlocks, SplitBlocks
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import (
    PATHS_NATIVE,
    NativeWeight,
    Packable,
    PackedWeight,
    RegimeWeight,
    SplitWeight,
    pack_linear_weights,
    parameter_names,
)
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.cpu.probe import ProbeResult, available_memory_bytes, probe_cached

logger = logging.getLogger(__name__)


class CpuOps(NamedTuple):
    """The kernels a model is built on: ``mode`` ("native" | "onednn" | "torch") and, for native, the loaded
    C kernels (None otherwise), which the norms, activations and rotary embedding are given.
    ``bf16_products`` (native, ``dtype="bfloat16"``): the model is built in float32 and only the linear
    layers' products are bfloat16 (weights rounded once, inputs at each product, float32 sums)."""

    mode: str
    kernels: CpuKernels | None
    bf16_products: bool = False
    probe: ProbeResult | None = None  # cpu_ops "auto": the start-up probe's figures, when it ran
    linear_paths: tuple[str, str] = PATHS_NATIVE  # native mode: "native" | "torch" for few-row, many-row products
    int16_rows: bool = False  # native: few-row products of 4-8-bit GGUF blocks on rows rounded to int16
    int16_prefill: bool = False  # with int16_rows: every step's rows rounded so, prefills' too

    def report(self) -> dict[str, object]:
        """What /stats shows of the CPU path: the mode, the kernels' ISA level, which path each regime of the
        linear products runs on and the probe's figures."""
        paths = self.linear_paths if self.native else (self.mode, self.mode)
        return {"cpu_ops": self.mode, "cpu_isa": self.kernels.isa if self.kernels is not None else None,
                "cpu_isa_features": list(self.kernels.isa_features) if self.kernels is not None else [],
                "cpu_linear_paths": {"few_rows": paths[0], "many_rows": paths[1]},
                "cpu_decode_activations": "int16" if self.int16_rows else "float32",
                "cpu_prefill_activations": "int16" if self.int16_prefill else "float32",
                "cpu_ops_probe": self.probe.as_dict() if self.probe is not None else None}

    @property
    def native(self) -> bool:
        return self.mode == "native"


TORCH_OPS = CpuOps("torch", None)


def resolve_cpu_ops(requested: str, device: torch.device, dtype: torch.dtype, isa: str = "auto",
                    probe_shape: tuple[int, int] | None = None, weight_format: str = "f32",
                    weight_values: int = 0, activations: tuple[str, str] = ("float32", "float32")) -> CpuOps:
    """The ops to build the model with. ValueError when "native" or "onednn" is asked for explicitly and
    cannot be had, or ``isa`` names a level this CPU cannot run. Not a CPU device: torch. ``probe_shape``
    (the model's hidden and intermediate sizes) and ``weight_format`` (``probe.model_weights``): "auto"
    keeps the C kernels for each regime of the linear products only where the probe finds them no slower
    than torch; ``weight_values`` (the checkpoint's): the regimes stay on the C kernels when torch's copy of
    the weights for one of them would take more than half the memory available. ``activations``: the requested
    ``cpu_decode_activations`` and ``cpu_prefill_activations`` (``int16_activations``); "int16" where the model does
    not run that regime's products on the C kernels is a ValueError, "auto" falls back to float32 there."""
    ops = _resolve(requested, device, dtype, isa, probe_shape, weight_format, weight_values, activations)
    where = f"{'device ' + device.type if device.type != 'cpu' else 'cpu_ops ' + repr(requested)}"
    forced_rows, forced_every = "int16" in activations, activations[1] == "int16"
    if forced_rows and (not ops.native or ops.linear_paths[0] != "native"):
        raise ValueError(f"cpu_decode_activations 'int16' needs the C kernels for decode steps, but {ops.mode!r} "
                         f"({where}) runs them")
    if forced_every and (not ops.native or ops.linear_paths[1] != "native"):
        raise ValueError(f"cpu_prefill_activations 'int16' needs the C kernels for many-row products, but "
                         f"{ops.mode if not ops.native else ops.linear_paths[1]!r} ({where}) runs them")
    if ops.int16_rows and ops.linear_paths[0] != "native":  # "auto" where the probe put decode steps on torch
        return ops._replace(int16_rows=False, int16_prefill=False)
    if ops.int16_prefill and ops.linear_paths[1] != "native":
        return ops._replace(int16_prefill=False)
    return ops


def int16_activations(activations: tuple[str, str], kernels: CpuKernels, weight_format: str,
                      bf16_products: bool) -> tuple[bool, bool]:
    """Whether decode steps' rows, and every step's, are rounded to int16 (``CpuOps.int16_rows``, ``int16_prefill``)
    for the requested ``cpu_decode_activations`` and ``cpu_prefill_activations``: "int16" as asked ("int16" prefill
    implies int16 decode), "float32" never, "auto" where it pays: the kernels' build multiplies int16 pairs in one
    instruction (its ``i16_dot`` bit: AVX-512 VNNI, AVX-VNNI) and most of the model's linear weights are 4-8-bit
    GGUF blocks kept as such (``weight_format``), multiplied in float32 (not ``bf16_products``). A rule of the
    build and the format, not a timing, so that every replica and restart computes the same outputs."""
    pays = ("i16_dot" in kernels.isa_features and weight_format in INT16_ROWS_FORMATS and not bf16_products)
    decode, prefill = activations
    every = prefill == "int16" or (prefill == "auto" and decode != "float32" and pays)
    return every or decode == "int16" or (decode == "auto" and pays), every


def _resolve(requested: str, device: torch.device, dtype: torch.dtype, isa: str, probe_shape: tuple[int, int] | None,
             weight_format: str, weight_values: int, activations: tuple[str, str]) -> CpuOps:
    if device.type != "cpu":
        return TORCH_OPS
    if requested in ("auto", "native"):
        if dtype not in (torch.float32, torch.bfloat16):
            reason = f"the C kernels run float32 or bfloat16 products, not {dtype}"
        else:
            load = load_cpu_kernels(isa)
            if load.kernels is not None:
                if activations[1] == "int16" and "i16_dot" not in load.kernels.isa_features:  # before any probe
                    raise ValueError(f"cpu_prefill_activations 'int16' needs int16 multiply-adds in one instruction "
                                     f"(AVX-512 VNNI, or AVX-VNNI): the {load.kernels.isa} build here has none, and "
                                     f"its float32 products are faster for many rows")
                bf16 = dtype == torch.bfloat16
                rows, every = int16_activations(activations, load.kernels, weight_format, bf16)
                native = CpuOps("native", load.kernels, bf16, int16_rows=rows, int16_prefill=every)
                if requested == "native" or probe_shape is None:
                    return native
                return _probed(native, load.kernels, probe_shape, weight_format, weight_values)
            reason = load.reason
        if requested == "native":
            raise ValueError(f"cpu_ops='native' is not available: {reason}")
        logger.warning("CPU C kernels not used (%s); linear layers on oneDNN or torch instead", reason)
    return _torch_ops(requested)


def _torch_ops(requested: str, probe: ProbeResult | None = None) -> CpuOps:
    if requested in ("auto", "onednn"):
        if torch.backends.mkldnn.is_available():
            return CpuOps("onednn", None, probe=probe)
        if requested == "onednn":
            raise ValueError("cpu_ops='onednn' is not available: torch was built without oneDNN")
    return CpuOps("torch", None, probe=probe)


def _probed(native: CpuOps, kernels: CpuKernels, shape: tuple[int, int], weight_format: str,
            weight_values: int) -> CpuOps:
    """cpu_ops "auto": per regime of the linear products, the C kernels unless the probe found them slower."""
    result = probe_cached(kernels, shape[0], shape[1], weight_format, native.bf16_products, native.int16_rows,
                          int16_every_row=native.int16_prefill)
    if result.paths == PATHS_NATIVE:
        logger.info("cpu_ops auto: the %s C kernels (%s)", kernels.isa, result.summary())
        return native._replace(probe=result)
    if "native" not in result.paths:
        chosen = _torch_ops("auto", result)
        logger.warning("cpu_ops auto: %s, not the %s C kernels, which are slower on this CPU (%s); cpu_ops "
                       "'native' forces them", chosen.mode, kernels.isa, result.summary())
        return chosen
    extra, available = weight_values * (2 if native.bf16_products else 4), available_memory_bytes()
    if available is not None and extra > available // 2:
        logger.warning("cpu_ops auto: the %s C kernels for all products, though torch ran %s-row products faster "
                       "(%s): its copy of the weights would take %.1f GiB of the %.1f GiB available", kernels.isa,
                       "many" if result.paths[0] == "native" else "few", result.summary(), extra / 2**30,
                       available / 2**30)
        return native._replace(probe=result)
    logger.warning("cpu_ops auto: the %s C kernels for %s-row products, torch for the others, which the C kernels "
                   "run slower on this CPU (%s)", kernels.isa, "few" if result.paths[0] == "native" else "many",
                   result.summary())
    return native._replace(probe=result, linear_paths=result.paths)


def pack_weights(
    model: nn.Module, ops: CpuOps, blocks: Mapping[str, QuantBlocks | SplitBlocks] | None = None, compact: bool = False
) -> int:
    """Pack the loaded linear weights for ``ops`` (native or onednn; native with ``compact`` keeps exact
    compact formats, from ``blocks`` where given, see linear.py); torch packs nothing. Returns how many."""
    if ops.mode == "torch":
        return 0
    if ops.native and ops.kernels is None:
        raise ValueError("cpu_ops 'native' needs the loaded kernels")
    kernels, compact, bf16_products, paths = _packing(ops, compact)
    packed = pack_linear_weights(model, kernels, blocks, compact, bf16_products, paths)
    if kernels is not None and ops.int16_rows and not use_int16_rows(model, ops.int16_prefill):
        raise ValueError("cpu_decode_activations 'int16' multiplies 4-8-bit GGUF blocks (Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, "
                         "Q6_K, Q8_0), and this model has none")
    return packed


def _packing(ops: CpuOps, compact: bool) -> tuple[CpuKernels | None, bool, bool, tuple[str, str]]:
    """How ``ops`` packs a linear weight (``Packable.pack``'s kernels, compact, bf16_products and paths): for the C
    kernels when they are loaded (native), else for oneDNN."""
    native = ops.native and ops.kernels is not None
    return (ops.kernels if native else None, compact and native, ops.bf16_products,
            ops.linear_paths if native else PATHS_NATIVE)


class PackAsLoaded:
    """``load_weights``' ``on_loaded`` on CPU: each linear weight packed for ``ops`` (as ``pack_weights`` packs it,
    ``blocks`` by parameter name) as soon as all its parts are loaded, and its float32 copy released then: the
    float32 weights of a layer are in memory at once, not the whole model's (an 8B GGUF file's: 32 GB). A shared
    weight (tied embeddings) is left to ``pack_weights``, which packs what is left after the load; ``blocks`` (the
    model's ``fused_quant_blocks``) loses each weight's blocks as it is packed. Torch ops pack nothing here either."""

    def __init__(self, model: nn.Module, ops: CpuOps, blocks: dict[str, QuantBlocks | SplitBlocks] | None,
                 compact: bool) -> None:
        self.how = _packing(ops, compact)
        self.int16 = (self.how[0] is not None and ops.int16_rows, ops.int16_prefill)  # no second copy at the end
        self.blocks = blocks or {}
        names = parameter_names(model)
        self.owners = {} if ops.mode == "torch" else {
            names[id(m.weight)][0]: m for m in model.modules()
            if isinstance(m, Packable) and isinstance(getattr(m, "weight", None), torch.Tensor)
            and len(names[id(m.weight)]) == 1}

    def __call__(self, name: str) -> None:
        module = self.owners.pop(name, None)
        if module is not None:
            kernels, compact, bf16_products, paths = self.how
            # the blocks leave the dict (a fused weight's concatenated copy is freed once packed)
            module.pack(True, kernels, self.blocks.pop(name, None), compact, bf16_products, paths)
            if self.int16[0] and module.packed is not None:
                module.packed = int16_variant(module.packed, self.int16[1])


def use_int16_rows(model: nn.Module, every_row: bool = False) -> int:
    """Switch every packed weight of ``model`` in a 4-8-bit GGUF block format (``abi.INT16_ROWS_FORMATS``, alone or as
    a part of a ``SplitWeight``, or a ``RegimeWeight``'s few-row side) to its int16-rows variant (``every_row``: the
    one whose many-row products round the rows to int16 too); returns how many weights (parts) run on int16 rows,
    those switched while loading (``PackAsLoaded``) included."""
    on_int16 = 0
    for m in model.modules():
        if getattr(m, "packed", None) is not None:
            m.packed = int16_variant(m.packed, every_row)
            on_int16 += sum(w.panels.fmt.rpartition("_")[2] in FORMAT_FLAGS for w in _native_parts(m.packed))
    logger.info("cpu_decode_activations int16: %d GGUF block weights (or parts) multiply %s rows rounded to int16",
                on_int16, "every step's" if every_row else "decode steps'")
    return on_int16


def int16_variant(packed: PackedWeight, every_row: bool) -> PackedWeight:
    """``packed`` with its 4-8-bit GGUF block panels in their int16-rows variant (see ``use_int16_rows``)."""
    if isinstance(packed, RegimeWeight):
        return dataclasses.replace(packed, few=int16_variant(packed.few, every_row))
    if isinstance(packed, SplitWeight):
        return dataclasses.replace(packed, parts=tuple(int16_variant(p, every_row) for p in packed.parts))
    if isinstance(packed, NativeWeight) and packed.panels.fmt in INT16_ROWS_FORMATS:
        return dataclasses.replace(packed, panels=packed.kernels.with_int16_rows(packed.panels, every_row))
    return packed


def _native_parts(packed: PackedWeight) -> list[NativeWeight]:
    """The C kernels' panels of ``packed`` that decode steps run on."""
    if isinstance(packed, RegimeWeight):
        return _native_parts(packed.few)
    if isinstance(packed, SplitWeight):
        return [w for p in packed.parts for w in _native_parts(p)]
    return [packed] if isinstance(packed, NativeWeight) else []
