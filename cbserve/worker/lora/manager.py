"""Multi-LoRA on the worker: adapter slots in every adapted linear layer, an LRU of loaded adapters, and the
batched product that adds each token's adapter to a mixed batch (S-LoRA / Punica's scheme).

- Every attention and dense-MLP projection of the model gets a ``LoRALinear``: ``max_loras`` slots of
  stacked weights, ``a`` [slots, cols, in] and ``b`` [slots, out, cols] (the scaling folded into ``b``). A
  fused projection (q/k/v, gate/up) holds its parts' adapters side by side in the columns: each part's ``B``
  fills only its own output rows, so one shrink and one expand serve all parts.
- ``LoRAManager.prepare_step`` puts the step's adapters in slots (the scheduler guarantees at most
  ``max_loras`` distinct ones a step, so one not used by this step can always make room) and cuts the batch
  into runs of one adapter (the runner orders a step's requests by adapter, so each adapter is one run of
  decodes and one of prefill chunks). Each adapted layer then adds ``(x_g A_s^T) B_s^T`` per run: one shrink
  and one expand per adapter and layer for the whole batch (on the CPU's C kernels one call for all runs,
  ``cb_lora_add_f32``; on CUDA one Triton launch of each, ``lora_triton.py``); rows of the base model cost
  nothing.
- ``dtype="bfloat16"`` on the C kernels (``CpuOps.bf16_products``: a float32 model whose linear layers multiply
  in bfloat16) keeps the slots in bfloat16 and runs the adapters as bfloat16 products too (``cb_lora_add_bf16``:
  x and x A^T rounded to bfloat16, float32 sums, as PEFT in bfloat16 rounds them).
- Adapters are loaded once and kept, cut to this rank's shard, in a host-side LRU of ``max_cpu_loras``; a busy
  adapter is never reloaded per request. An adapter whose ``LoRARequest`` names its content (``digest``) comes
  from the manager's ``source`` (the content the front end checked: served, the app's store, which the worker
  actor's source fetches; offline, the ``LLM``'s), else from its folder; either way it is checked whole again
  (``lora_files.load_adapter``) and its digest must match: a file changed since it was checked never runs.
- An adapter that fails to load (``AdapterLoadError``, naming its ``lora_int_id``) leaves every slot as it was,
  or empty where it was being written, and out of the LRU: the step's other adapters run as if it never came.

Tensor parallelism: a column-parallel layer keeps ``A`` whole and this rank's rows of ``B``; a row-parallel
layer keeps this rank's columns of ``A`` and all of ``B`` and adds its partial product before the layer's
all-reduce (the sum over ranks of x_r A_r^T B^T is x A^T B^T).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.lora_segments import LoRASegments
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear
from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.files import (
    AdapterContent,
    AdapterFiles,
    AdapterLoadError,
    AdapterSource,
    load_adapter,
    read_content,
)
from cbserve.worker.parallel import tp_rank

logger = logging.getLogger(__name__)

# checkpoint projection -> (model layer attribute path, part of a fused layer; None: every part / unfused)
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", None), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", None), "down_proj": ("mlp.down_proj", None),
}  # fmt: skip
LAYER_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class LoRAStep:
    """The adapters of the current step: the batch's runs of consecutive tokens of one adapter, (first row, rows,
    slot), and for the CUDA kernels every token's slot (-1: the base model)."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)
    token_slots: torch.Tensor | None = None
    use_triton: bool = False
    kernels: CpuKernels | None = None  # the C kernels (float32 CPU models on the native ops, bf16 products too)
    # the C kernel's segment tables of this step, by the columns each slot uses in a layer
    segments: dict[tuple[int, ...], LoRASegments] = field(default_factory=dict)

    def segments_for(self, used: list[int]) -> LoRASegments:
        key = tuple(used)
        table = self.segments.get(key)
        if table is None:
            rows = [(start, n, slot, used[slot]) for start, n, slot in self.runs]
            table = self.segments[key] = LoRASegments.of(torch.tensor(rows, dtype=torch.int32))
        return table


# One loaded adapter on this rank: (layer index, layer target) -> (A [cols, in_shard], B [out_shard, cols]).
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRALinear:
    """The adapter slots of one linear layer (see the module docstring). B is kept as [slots, out, cols] for the
    Triton kernels and transposed, [slots, cols, out], otherwise (each expand then streams rows of out values)."""

    def __init__(self, layer: nn.Module, step: LoRAStep, num_slots: int, cols: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        fan_out, fan_in = _shape(layer)
        self.step = step
        self.transposed = not step.use_triton
        self.a = torch.zeros(num_slots, cols, fan_in, dtype=dtype, device=device)
        b_shape = (num_slots, cols, fan_out) if self.transposed else (num_slots, fan_out, cols)
        self.b = torch.zeros(*b_shape, dtype=dtype, device=device)
        self.used = [0] * num_slots  # columns in use per slot

    def _b(self, slot: int, cols: int) -> torch.Tensor:
        """Slot ``slot``'s B^T [cols, out]."""
        return self.b[slot, :cols] if self.transposed else self.b[slot, :, :cols].t()

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.used[slot] = 0

    def load(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.clear(slot)
        if weights is not None:
            a, b = weights
            cols = a.shape[0]
            self.a[slot, :cols].copy_(a)
            self._b(slot, cols).copy_(b.t())
            self.used[slot] = cols

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each token's adapter product (in place)."""
        step = self.step
        if step.use_triton and step.token_slots is not None:
            from cbserve.worker.lora.triton import add_lora_triton

            add_lora_triton(y, x, self.a, self.b, step.token_slots)
            return
        if step.kernels is not None and y.dtype == torch.float32:  # one C call for every run
            step.kernels.lora_add_(x, y, self.a, self.b, step.segments_for(self.used))
            return
        for start, rows, slot in step.runs:
            cols = self.used[slot]
            if cols:
                end = start + rows
                y[start:end] += _product(x[start:end], self.a[slot, :cols], self._b(slot, cols))


def _product(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """(x @ a.T) @ bt in x's dtype; bfloat16 slots on a float32 model: the C kernel's bfloat16 products (x and
    x @ a.T rounded to bfloat16, float32 sums of the exact products)."""
    if a.dtype == x.dtype:
        return (x @ a.t()) @ bt
    t = x.to(a.dtype).float() @ a.float().t()
    return t.to(a.dtype).float() @ bt.float()


def _shape(layer: nn.Module) -> tuple[int, int]:
    """(out, in) of this rank's shard of a linear layer (its dense weight may have been released by packing)."""
    if isinstance(layer, ColumnParallelLinear):
        return sum(layer.shard_sizes), int(layer.input_size)
    if isinstance(layer, RowParallelLinear):
        return int(layer.output_size), layer.in_shard
    raise TypeError(f"cannot adapt a {type(layer).__name__}")


def _parts(layer: nn.Module) -> int:
    return len(layer.shard_sizes) if isinstance(layer, ColumnParallelLinear) else 1


class LoRAManager:
    """The adapter slots of one model shard and the adapters loaded on this rank."""

    def __init__(self, model: nn.Module, hf_config: Any, max_loras: int, max_lora_rank: int, cache_size: int,
                 dtype: torch.dtype, device: torch.device, use_triton: bool | None = None,
                 source: AdapterSource | None = None) -> None:
        """``use_triton``: the Triton kernels (None: on CUDA when triton imports); else the model's C kernels
        where it runs on them (float32), else torch. The model's ``ops`` (``CpuOps``) say whether it runs
        bfloat16 products on the C kernels: the slots are then bfloat16 (``dtype`` is the model's, float32).
        ``source``: the checked content of an adapter whose request names it (``digest``); None: its folder."""
        self.info = ModelInfo.from_hf_config(hf_config.to_dict())
        self.source = source
        self.max_lora_rank, self.cache_size = max_lora_rank, cache_size
        ops = getattr(model, "ops", None)
        kernels, bf16_products = getattr(ops, "kernels", None), bool(getattr(ops, "bf16_products", False))
        if use_triton is None:
            use_triton = device.type == "cuda" and _triton_available()
        if use_triton and bf16_products:
            raise ValueError("LoRA on the Triton kernels does not run the CPU kernels' bfloat16 products")
        self.dtype, self.device = torch.bfloat16 if bf16_products else dtype, device  # the slots' and adapters'
        self.step = LoRAStep(use_triton=use_triton, kernels=None if use_triton or dtype != torch.float32 else kernels)
        self.linears: dict[tuple[int, str], tuple[nn.Module, LoRALinear]] = {}
        for i, decoder_layer in enumerate(model.model.layers):
            for target in LAYER_TARGETS:
                layer = _find(decoder_layer, target)
                if layer is None:
                    continue
                slots = LoRALinear(layer, self.step, max_loras, _parts(layer) * max_lora_rank, self.dtype, device)
                layer.lora = slots
                self.linears[(i, target)] = (layer, slots)
        model.lora_step = self.step  # the model's one-call C layer driver stands aside in steps with adapters
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id held by each slot
        self.slot_used_at = [0] * max_loras
        self.cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.num_steps = self.num_loads = self.num_evictions = 0

    # ---- one step ------------------------------------------------------------------------------
    def prepare_step(self, loras: Sequence[LoRARequest | None], lengths: Sequence[int]) -> None:
        """The step's batch holds ``lengths[i]`` tokens of request i, in order, run with ``loras[i]``.
        ``AdapterLoadError`` (its ``lora_int_id``) when an adapter cannot be loaded: the slots stay consistent."""
        self.num_steps += 1
        step = self.step
        step.runs = []
        step.token_slots = None
        step.segments = {}
        if not any(lora is not None for lora in loras):
            return
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        slot_of = {lid: self._ensure_slot(lora, wanted) for lid, lora in wanted.items()}
        runs: list[tuple[int, int, int]] = []
        start = 0
        for lora, n in zip(loras, lengths, strict=True):
            if lora is not None:
                slot = slot_of[lora.lora_int_id]
                if runs and runs[-1][2] == slot and runs[-1][0] + runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], runs[-1][1] + n, slot)
                else:
                    runs.append((start, n, slot))
            start += n
        step.runs = runs
        if step.use_triton:
            slots = torch.full((start,), -1, dtype=torch.int32)
            for first, n, slot in runs:
                slots[first : first + n] = slot
            step.token_slots = slots.to(self.device)

    def _ensure_slot(self, lora: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        lid = lora.lora_int_id
        if lid in self.slots:
            slot = self.slots.index(lid)
        else:
            free = [i for i, held in enumerate(self.slots) if held is None or held not in wanted]
            if not free:
                raise RuntimeError(f"{len(wanted)} adapters in one step but only {len(self.slots)} slots")
            slot = min(free, key=lambda i: (self.slots[i] is not None, self.slot_used_at[i]))
            weights = self._weights(lora)  # AdapterLoadError: nothing changed yet
            try:
                for key, (_, slots) in self.linears.items():
                    slots.load(slot, weights.get(key))
            except Exception as e:  # half written: the slot is emptied, the adapter leaves the LRU
                self._clear_slot(slot)
                self.cache.pop(lid, None)
                raise AdapterLoadError(lid, f"LoRA adapter {lora.lora_name!r} (id {lid}) does not fit its slot: "
                                            f"{type(e).__name__}: {e}") from e
            self.slots[slot] = lid
        self.slot_used_at[slot] = self.num_steps
        return slot

    def _clear_slot(self, slot: int) -> None:
        for _, slots in self.linears.values():
            slots.clear(slot)
        self.slots[slot] = None
        self.slot_used_at[slot] = 0

    # ---- loading -------------------------------------------------------------------------------
    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        cached = self.cache.get(lora.lora_int_id)
        if cached is not None:
            self.cache.move_to_end(lora.lora_int_id)
            return cached
        weights = self._load(lora)
        self.num_loads += 1
        self.cache[lora.lora_int_id] = weights
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
            self.num_evictions += 1
        logger.info("LoRA adapter %r (id %d) loaded from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)
        return weights

    def _load(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's weights on this rank; AdapterLoadError says why not (whatever went wrong)."""
        from safetensors.torch import load as load_tensors

        lid = lora.lora_int_id
        try:
            content = self._content(lora)
            files = load_adapter(content, self.info, self.max_lora_rank)
            tensors = load_tensors(content.weights)
            return assemble(files, tensors, {k: layer for k, (layer, _) in self.linears.items()}, self.dtype,
                            self.device)
        except AdapterLoadError:
            raise
        except Exception as e:
            logger.warning("LoRA adapter %r (id %d, %s) cannot be loaded: %s: %s", lora.lora_name, lid,
                           lora.lora_path, type(e).__name__, e)
            raise AdapterLoadError(lid, f"LoRA adapter {lora.lora_name!r} (id {lid}) cannot be loaded: {e}") from e

    def _content(self, lora: LoRARequest) -> AdapterContent:
        """The adapter's bytes: by digest from the source, else read from its folder (and then the digest, when
        the request names one, must still match)."""
        if lora.digest is None:
            return read_content(lora.lora_path)
        content = AdapterContent.of(*self.source(lora)) if self.source is not None else read_content(lora.lora_path)
        if content.digest != lora.digest:
            raise AdapterLoadError(lora.lora_int_id, f"LoRA adapter {lora.lora_name!r} (id {lora.lora_int_id}): its "
                                                     "content is not the one checked when it was loaded")
        return content


def assemble(files: AdapterFiles, tensors: dict[str, torch.Tensor], layers: dict[tuple[int, str], nn.Module],
             dtype: torch.dtype, device: torch.device) -> AdapterWeights:
    """This rank's (A, B) per adapted layer: parts side by side in the columns, B scaled and placed in its part's
    rows of this rank's shard."""
    pieces: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, int | None]]] = {}
    for m in files.modules:
        target, part = TARGETS[m.projection]
        a = tensors[m.a_key].to(torch.float32)
        b = tensors[m.b_key].to(torch.float32) * m.scaling
        pieces.setdefault((m.layer, target), []).append((a, b, part))
    out: AdapterWeights = {}
    rank = tp_rank()
    for key, parts in pieces.items():
        layer = layers[key]
        fan_out, _ = _shape(layer)
        a_cols, b_full = [], torch.zeros(fan_out, sum(p[0].shape[0] for p in parts))
        col = 0
        for a, b, part in parts:
            r = a.shape[0]
            if isinstance(layer, RowParallelLinear):
                a = a.narrow(1, rank * layer.in_shard, layer.in_shard)
                b_full[:, col : col + r] = b
            else:
                _place_column_parallel(layer, b, part, b_full[:, col : col + r], rank)
            a_cols.append(a)
            col += r
        out[key] = (torch.cat(a_cols).to(device=device, dtype=dtype), b_full.to(device=device, dtype=dtype))
    return out


def _place_column_parallel(layer: ColumnParallelLinear, b: torch.Tensor, part: int | None, dest: torch.Tensor,
                           rank: int) -> None:
    """Copy this rank's rows of a part's B (or of every part's, for a fused checkpoint's B) into ``dest``."""
    parts = range(len(layer.output_sizes)) if part is None else [part]
    full_rows = b.split(layer.output_sizes) if part is None else [b]
    for p, rows in zip(parts, full_rows, strict=True):
        shard = layer.shard_sizes[p]
        offset = sum(layer.shard_sizes[:p])
        dest[offset : offset + shard] = rows.narrow(0, rank * shard, shard)


def _find(module: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) else None


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
