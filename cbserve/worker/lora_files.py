"""A PEFT LoRA adapter folder read and checked against a model without torch: ``adapter_config.json`` and the
header of ``adapter_model.safetensors`` (its JSON index of tensor names, dtypes and shapes; no tensor is
read). The front end calls ``read_adapter`` + ``check_adapter`` to answer 400 with the reason before a
request reaches an engine; the worker loads the tensors it names (``lora.py``).

Supported: LoRA (not DoRA) on any subset of the attention (q, k, v, o) and dense MLP (gate, up, down)
projections, or on the fused ``qkv_proj`` / ``gate_up_proj`` of the families whose checkpoints fuse them
(Phi-3); ``lora_alpha`` scaling, rsLoRA (alpha / sqrt(r)) and per-module ``rank_pattern`` / ``alpha_pattern``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model_info import ModelInfo

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_CHECKPOINT_TYPES = frozenset({"phi3"})  # families whose checkpoints store q/k/v and gate/up fused
MOE_TYPES = frozenset({"mixtral", "qwen3_moe"})  # adapters on their attention only
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """The folder is not a usable LoRA adapter for this model (the message says why: a 400)."""


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection of one layer: lora_A [rank, in] and lora_B [out, rank], scaled by ``scaling``."""

    layer: int
    projection: str  # the checkpoint's name: q_proj, ..., or qkv_proj / gate_up_proj (fused checkpoints)
    rank: int
    scaling: float
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterFiles:
    path: Path
    rank: int  # the largest rank of any module
    modules: tuple[AdapterModule, ...]
    base_model: str | None  # ``base_model_name_or_path``, as the adapter says (informational)

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(m.projection for m in self.modules)


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAAdapterError(f"{folder} is not a folder (a LoRA adapter is a PEFT folder with {CONFIG_FILE})")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as e:
        raise LoRAAdapterError(f"{folder} has no {CONFIG_FILE}: not a PEFT adapter") from e
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{folder / CONFIG_FILE} cannot be read: {e}") from e
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        raise LoRAAdapterError(f"{folder} is a {cfg.get('peft_type') if isinstance(cfg, dict) else '?'} adapter, "
                               "not LoRA")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"{folder}: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{folder}: adapters that train biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"{folder}: modules_to_save {cfg['modules_to_save']} (fully trained modules) "
                               "are not supported")
    return cfg


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor index of a safetensors file: name -> {"dtype", "shape", "data_offsets"}."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except FileNotFoundError as e:
        raise LoRAAdapterError(f"{path.parent} has no {path.name}") from e
    except (OSError, ValueError, struct.error) as e:
        raise LoRAAdapterError(f"{path} is not a safetensors file: {e}") from e
    header.pop("__metadata__", None)
    return header


def _pattern_value(patterns: Mapping[str, Any], key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first pattern that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.search(rf"(^|\.){pattern}$", key):
            return float(value)
    return default


def read_adapter(path: str | Path) -> AdapterFiles:
    """Read a PEFT LoRA folder; LoRAAdapterError says why it is not one (or one cbserve cannot serve)."""
    folder = Path(path)
    cfg = _read_config(folder)
    header = read_safetensors_header(folder / WEIGHTS_FILE)
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rsl = bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in header:
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"{folder}: tensor {key!r} is not a LoRA weight of an attention or MLP projection")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
    modules = []
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{folder}: layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        r_shape = header[ab["A"]]["shape"]
        name = f"layers.{layer}.{proj}"
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, name, rank))
        a = _pattern_value(cfg.get("alpha_pattern") or {}, name, alpha)
        if len(r_shape) != 2 or r_shape[0] != r:
            raise LoRAAdapterError(f"{folder}: {ab['A']} has shape {r_shape}, expected rank {r} rows")
        modules.append(AdapterModule(layer, proj, r, a / (math.sqrt(r) if rsl else r), ab["A"], ab["B"]))
    if not modules:
        raise LoRAAdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights")
    base = cfg.get("base_model_name_or_path")
    return AdapterFiles(folder, max(m.rank for m in modules), tuple(modules), None if base is None else str(base))


def projection_shapes(info: ModelInfo) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection an adapter may target on this model."""
    h, q = info.hidden_size or info.num_attention_heads * info.head_dim, info.num_attention_heads * info.head_dim
    kv, mlp = info.num_key_value_heads * info.head_dim, info.intermediate_size or 0
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "qkv_proj": (h, q + 2 * kv)}
    if info.model_type not in MOE_TYPES:
        shapes |= {"gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h), "gate_up_proj": (h, 2 * mlp)}
    names = FUSED_PROJECTIONS if info.model_type in FUSED_CHECKPOINT_TYPES else SPLIT_PROJECTIONS
    return {n: s for n, s in shapes.items() if n in names}


def check_adapter(adapter: AdapterFiles, info: ModelInfo, max_lora_rank: int) -> None:
    """LoRAAdapterError when ``adapter`` cannot run on the model ``info`` describes: a rank over
    ``max_lora_rank``, a projection the model lacks, a layer past its last, or shapes of another model."""
    if adapter.rank > max_lora_rank:
        raise LoRAAdapterError(f"{adapter.path}: rank {adapter.rank} is over max_lora_rank {max_lora_rank}")
    shapes = projection_shapes(info)
    lacking = sorted(adapter.projections - set(shapes))
    if lacking:
        raise LoRAAdapterError(f"{adapter.path}: target modules {lacking} are not projections of this "
                               f"{info.model_type} model (it has {sorted(shapes)})")
    header = read_safetensors_header(adapter.path / WEIGHTS_FILE)
    for m in adapter.modules:
        if m.layer >= info.num_hidden_layers:
            raise LoRAAdapterError(f"{adapter.path}: layer {m.layer} is past the model's {info.num_hidden_layers}")
        fan_in, fan_out = shapes[m.projection]
        a, b = header[m.a_key]["shape"], header[m.b_key]["shape"]
        if list(a) != [m.rank, fan_in] or list(b) != [fan_out, m.rank]:
            raise LoRAAdapterError(
                f"{adapter.path}: layer {m.layer} {m.projection} has lora_A {a} and lora_B {b}, but this model "
                f"needs [{m.rank}, {fan_in}] and [{fan_out}, {m.rank}]: an adapter of another base model?")
