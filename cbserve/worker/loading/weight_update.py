"""A built model's weights replaced in place: an RL trainer's new weights between steps (``ModelRunner.update_weights``;
``sleep`` / ``wake_up`` reuse its shapes, loading/sleep_mode.py).

``update_model_weights(model, weights)``: HF-named float tensors in the checkpoint's layout (full, unsharded: each
parameter's ``weight_loader`` keeps this rank's shard and places q/k/v, gate/up in their fused parameter).

- Atomic from the caller's view: every tensor is checked first (it must map to a parameter through the model's
  ``map_name`` / ``_pieces``, in the full shape its loader expects); a ValueError lists the bad ones and nothing
  changes. A fused parameter whose dense copy was released (packed for the CPU kernels or oneDNN, or quantized to
  FP8) is rebuilt from its parts, so the update must name all of them (ValueError naming the missing ones); where
  the dense copy is kept (the torch ops) a partial update of a fused parameter is fine.
- A released weight gets its dense parameter back (this rank's shard shape), loaded, then packed again the way
  ``finish_loading`` packed it (same kernels, ``compact`` in the smallest exact format: no GGUF blocks, as the new
  values are no checkpoint's, ``bf16_products``, the regime paths) and the dense copy is released again; the C
  layer driver (``NativeLayers``) is rebuilt over the new panels. FP8 layers are re-quantized as
  ``quantize_linear_weights`` does, into the existing FP8 tensors.
- On CUDA every parameter the forward pass reads is copied in place (the loaders write into ``param.data``), so
  captured CUDA graphs stay valid.
- Tied embeddings: ``model.embed_tokens.weight`` also refreshes the LM head's packed copy (they share the
  parameter); ``lm_head.weight`` on a tied model is skipped, as ``load_weights`` skips it (reported in ``skipped``),
  and so are rotary tables.
- A draft model (speculative decoding) is not updated; LoRA adapters stay as they are (applied unmerged on top).
- Not touched: the KV cache and the KV tiers hold keys and values of the old weights (the scheduler resets its
  prefix cache). A GGUF model's compact blocks are not reused: new values are packed as float32 or bfloat16
  (SmolLM2: 4 bytes a weight after an update instead of Q4_1's 0.625). Until they are re-packed the re-made dense
  copies sit beside the old packed ones (peak: + the updated layers' float32 bytes).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from cbserve.worker.cpu.linear import PATHS_NATIVE
from cbserve.worker.layers.basic import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from cbserve.worker.layers.fp8_linear import Fp8Weight
from cbserve.worker.models.causal_lm import FUSED_PARTS
from cbserve.worker.models.native_layers import NativeLayers


@dataclass
class WeightUpdateReport:
    num_tensors: int  # tensors loaded (skipped ones not counted)
    num_bytes: int  # their bytes, as given
    validate_s: float
    load_s: float  # through the weight loaders (dense parameters re-made where packing had released them)
    pack_s: float  # re-packing / re-quantizing, and the C layer driver rebuilt
    repacked: int  # modules whose packed copy was rebuilt
    skipped: list[str] = field(default_factory=list)  # tied lm_head.weight, rotary tables

    def as_dict(self) -> dict[str, Any]:
        total = self.validate_s + self.load_s + self.pack_s
        return {**asdict(self), "total_s": total, "gb_per_s": self.num_bytes / total / 1e9 if total > 0 else 0.0}


@dataclass(frozen=True)
class _Piece:
    name: str  # the checkpoint name it came from
    target: str  # the parameter
    shard: int | None  # part of a fused parameter (None: all of it)
    tensor: torch.Tensor


def owner_of(model: nn.Module, target: str) -> tuple[nn.Module, str]:
    path, _, attr = target.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def full_shape(model: Any, owner: nn.Module, attr: str, shard: int | None, param: torch.Tensor) -> tuple[int, ...]:
    """The full (unsharded) checkpoint shape of ``owner.<attr>`` (of its part ``shard``) its loader expects."""
    if isinstance(owner, ColumnParallelLinear):
        rows = owner.output_sizes[shard] if shard is not None else sum(owner.output_sizes)
        return (rows, owner.input_size) if attr == "weight" else (rows,)
    if isinstance(owner, RowParallelLinear):
        return (owner.output_size, owner.in_shard * owner.tp_size) if attr == "weight" else (owner.output_size,)
    if isinstance(owner, VocabParallelEmbedding):
        return owner.vocab_size, int(model.config.hidden_size)
    return tuple(param.shape)


def dense_shape(model: Any, owner: nn.Module, attr: str, param: torch.Tensor) -> tuple[int, ...]:
    """This rank's shape of a parameter, also where packing or FP8 released its dense copy."""
    if param.numel() > 0:
        return tuple(param.shape)
    if isinstance(owner, ColumnParallelLinear) and attr == "weight":
        return sum(owner.shard_sizes), owner.input_size
    if isinstance(owner, RowParallelLinear) and attr == "weight":
        return owner.output_size, owner.in_shard
    if isinstance(owner, VocabParallelEmbedding):
        return owner.shard, int(model.config.hidden_size)
    raise ValueError(f"no dense shape known for the released parameter {type(owner).__name__}.{attr}")


def _check_piece(model: Any, params: Mapping[str, nn.Parameter], p: _Piece) -> str | None:
    """Why this piece cannot be loaded, or None."""
    if p.target not in params:
        return f"no parameter {p.target!r} in this model"
    owner, attr = owner_of(model, p.target)
    parts = len(owner.output_sizes) if isinstance(owner, ColumnParallelLinear) else 1
    if p.shard is not None and not (isinstance(owner, ColumnParallelLinear) and 0 <= p.shard < parts):
        return f"part {p.shard} of {p.target!r}, which has {parts} part(s)"
    want = full_shape(model, owner, attr, p.shard, params[p.target])
    if tuple(p.tensor.shape) != want:
        return f"shape {tuple(p.tensor.shape)}, expected {want}"
    return None


def plan_update(
    model: Any, weights: list[tuple[str, torch.Tensor]], params: Mapping[str, nn.Parameter]
) -> tuple[list[_Piece], list[str]]:
    """The pieces to load and the names skipped; ValueError listing every bad tensor (nothing loaded yet)."""
    pieces: list[_Piece] = []
    skipped: list[str] = []
    bad: list[str] = []
    for name, tensor in weights:
        if "rotary_emb" in name or (name == "lm_head.weight" and model.tie_word_embeddings):
            skipped.append(name)
            continue
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            bad.append(f"{name}: not a floating-point tensor")
            continue
        try:
            found = [_Piece(name, t, s, x) for t, s, x in model._pieces(name, tensor, params)]
        except (ValueError, AttributeError) as e:
            bad.append(f"{name}: {e}")
            continue
        problems = [why for p in found if (why := _check_piece(model, params, p)) is not None]
        bad += [f"{name}: {why}" for why in problems]
        pieces += found if not problems else []
    if bad:
        raise ValueError(f"weight update refused, nothing changed: {len(bad)} bad tensor(s): " + "; ".join(bad[:20]))
    _check_fused_complete(model, params, pieces)
    return pieces, skipped


def _part_name(name: str, shard: int, target: str) -> str:
    """The checkpoint name of part ``shard`` of ``target``, from the name of one of its other parts."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in FUSED_PARTS:
            fused = FUSED_PARTS[p][0]
            sibling = next(q for q, (f, s) in FUSED_PARTS.items() if f == fused and s == shard)
            return ".".join([*parts[:i], sibling, *parts[i + 1 :]])
    return f"part {shard} of {target}"


def _check_fused_complete(model: Any, params: Mapping[str, nn.Parameter], pieces: list[_Piece]) -> None:
    """ValueError where a fused parameter whose dense copy was released is not given all its parts."""
    given: dict[str, dict[int, str]] = defaultdict(dict)
    for p in pieces:
        if p.shard is not None and params[p.target].numel() == 0:
            given[p.target][p.shard] = p.name
    missing: list[str] = []
    for target, shards in given.items():
        owner, _ = owner_of(model, target)
        any_name = next(iter(shards.values()))
        missing += [_part_name(any_name, s, target) for s in range(len(owner.output_sizes)) if s not in shards]
    if missing:
        raise ValueError(
            "weight update refused, nothing changed: fused weights packed for the CPU kernels or quantized (their "
            f"dense copy released) are rebuilt from all their parts; missing: {', '.join(missing)}"
        )


def update_model_weights(
    model: Any, weights: Iterable[tuple[str, torch.Tensor]], compact: bool = False
) -> WeightUpdateReport:
    """Load ``weights`` (HF names, full tensors) into ``model`` in place and re-pack what they change (see the module
    docstring). ``compact``: the config's ``cpu_compact_weights`` (the C kernels' smallest exact formats)."""
    t0 = time.perf_counter()
    named = list(weights)  # an iterator is read once: checked whole before anything is loaded
    params = dict(model.named_parameters(remove_duplicate=False))
    pieces, skipped = plan_update(model, named, params)
    t1 = time.perf_counter()
    with torch.no_grad():
        touched = _load_pieces(model, pieces, params)
    _sync(touched)
    t2 = time.perf_counter()
    with torch.no_grad():
        repacked = repack_modules(model, touched, compact)
    t3 = time.perf_counter()
    skip = set(skipped)
    loaded = [t for n, t in named if n not in skip]
    return WeightUpdateReport(
        len(loaded), sum(t.numel() * t.element_size() for t in loaded), t1 - t0, t2 - t1, t3 - t2, repacked, skipped
    )


def _sync(params: Iterable[torch.Tensor]) -> None:
    if any(p.is_cuda for p in params):
        torch.cuda.synchronize()


def _load_pieces(model: Any, pieces: list[_Piece], params: Mapping[str, nn.Parameter]) -> list[nn.Parameter]:
    """Each piece through its parameter's loader, the dense parameter made again where it was released."""
    touched: dict[int, nn.Parameter] = {}
    for p in pieces:
        param = params[p.target]
        if param.numel() == 0:  # released by packing / FP8: every part is given (checked), so all of it is written
            owner, attr = owner_of(model, p.target)
            param.data = torch.empty(dense_shape(model, owner, attr, param), dtype=param.dtype, device=param.device)
        if p.shard is None:
            param.weight_loader(param, p.tensor)
        else:
            param.weight_loader(param, p.tensor, p.shard)
        touched[id(param)] = param
    return list(touched.values())


def repack_modules(model: Any, touched: Iterable[torch.Tensor], compact: bool) -> int:
    """Rebuild the packed copy of every module whose ``weight`` is one of ``touched`` (as ``finish_loading`` /
    ``quantize_linear_weights`` made it), then the C layer driver; returns how many modules were re-packed."""
    ids = {id(t) for t in touched}
    names: dict[int, int] = defaultdict(int)
    for _, param in model.named_parameters(remove_duplicate=False):
        names[id(param)] += 1
    ops = model.ops
    native = ops.native and ops.kernels is not None
    kernels = ops.kernels if native else None
    paths = ops.linear_paths if native else PATHS_NATIVE
    repacked = 0
    for m in model.modules():
        packed, weight = getattr(m, "packed", None), getattr(m, "weight", None)
        if packed is None or id(weight) not in ids:
            continue
        if isinstance(packed, Fp8Weight):
            _requantize(m, packed)
        else:
            m.packed = None
            m.pack(names[id(weight)] == 1, kernels, None, compact and native, ops.bf16_products, paths)
        repacked += 1
    if repacked and native:
        model.native_layers = NativeLayers.build(model, ops.kernels)
    return repacked


def _requantize(module: nn.Module, packed: Fp8Weight) -> None:
    """``Fp8Weight.quantize`` of the module's new dense weight, copied into the FP8 tensors it has (their storage
    stays: CUDA graphs read it), then the dense copy released as ``quantize_linear_weights`` does."""
    new = Fp8Weight.quantize(module.weight)
    packed.weight.copy_(new.weight)
    packed.scale.copy_(new.scale)
    module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
