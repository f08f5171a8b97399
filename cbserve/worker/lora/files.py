"""A PEFT LoRA adapter read whole and checked against a model without torch. ``read_content`` reads the folder's
``adapter_config.json`` and ``adapter_model.safetensors`` as bytes (an ``AdapterContent``, named by the sha256
digest of both); ``load_adapter`` checks everything a worker will run from them: the config (LoRA, not DoRA...),
every tensor (float16, bfloat16 or float32, its byte range, finite values: ``safetensors_check.py``), each
projection's A and B shapes against the model's, the rank against ``max_lora_rank``, the layers. The front end
checks an adapter so before a request reaches an engine, keeps the bytes it checked, and the workers run exactly
those (``lora.py`` gets them by digest and checks them again).

Errors are ``LoRAAdapterError``s whose messages name no path (a client may read them); the caller adds the
folder where the reader is the operator. ``AdapterFilesError``: the folder cannot be read as a LoRA adapter
(missing, not a folder, a file missing or unreadable, not LoRA, not safetensors): the front end answers a client
one message for all of these. ``AdapterLoadError``: an adapter failed on a worker; it carries the adapter's id,
so that only the requests using it fail.

Supported: LoRA (not DoRA) on any subset of the attention (q, k, v, o) and dense MLP (gate, up, down)
projections, or on the fused ``qkv_proj`` / ``gate_up_proj`` of the families whose checkpoints fuse them
(Phi-3); ``lora_alpha`` scaling, rsLoRA (alpha / sqrt(r)) and per-module ``rank_pattern`` / ``alpha_pattern``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.safetensors_check import Index, SafetensorsError, TensorError, check_tensors, read_index

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FUSED_CHECKPOINT_TYPES = frozenset({"phi3"})  # families whose checkpoints store q/k/v and gate/up fused
MOE_TYPES = frozenset({"mixtral", "qwen3_moe"})  # adapters on their attention only
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# Where a worker gets an adapter's checked content: (adapter_config.json bytes, adapter_model.safetensors bytes).
AdapterSource = Callable[[LoRARequest], tuple[bytes, bytes]]


class LoRAAdapterError(ValueError):
    """The adapter is not usable with this model (the message says why, naming no path: a 400)."""


class AdapterFilesError(LoRAAdapterError):
    """The folder cannot be read as a PEFT LoRA adapter (what a client is told nothing more precise about)."""


class AdapterLoadError(LoRAAdapterError):
    """An adapter failed on a worker: the requests using ``lora_int_id`` fail, the others run on."""

    def __init__(self, lora_int_id: int, message: str) -> None:
        super().__init__(message)
        self.lora_int_id = lora_int_id

    def __reduce__(self) -> tuple[Any, ...]:  # across Ray and the step channel
        return AdapterLoadError, (self.lora_int_id, str(self))


@dataclass(frozen=True)
class AdapterContent:
    """An adapter's two files as bytes, and ``digest``, the name of both (``content_digest``)."""

    config: bytes = field(repr=False)
    weights: bytes = field(repr=False)
    digest: str

    @classmethod
    def of(cls, config: bytes, weights: bytes) -> AdapterContent:
        return cls(config, weights, content_digest(config, weights))


def content_digest(config: bytes, weights: bytes) -> str:
    """``sha256:<hex>`` of the config's length, the config and the weights."""
    h = hashlib.sha256(len(config).to_bytes(8, "little"))
    h.update(config)
    h.update(weights)
    return f"sha256:{h.hexdigest()}"


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
    """A parsed adapter: its modules, and the content (and the safetensors index) they were read from."""

    path: Path
    rank: int  # the largest rank of any module
    modules: tuple[AdapterModule, ...]
    base_model: str | None  # ``base_model_name_or_path``, as the adapter says (informational)
    content: AdapterContent = field(repr=False, compare=False)
    index: Index = field(repr=False, compare=False)
    data_start: int = field(repr=False, compare=False)

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(m.projection for m in self.modules)


def read_content(path: str | Path) -> AdapterContent:
    """The bytes of the PEFT folder ``path`` (its config checked to be LoRA's before the weights are read)."""
    folder = Path(path)
    try:
        is_dir = folder.is_dir()
    except OSError as e:  # a folder it may not look into
        raise AdapterFilesError(f"cannot be looked at: {e}") from e
    if not is_dir:
        raise AdapterFilesError(f"not a folder (a LoRA adapter is a PEFT folder with {CONFIG_FILE})")
    config = _read(folder / CONFIG_FILE, f"no {CONFIG_FILE}: not a PEFT adapter")
    _parse_config(config)
    return AdapterContent.of(config, _read(folder / WEIGHTS_FILE, f"no {WEIGHTS_FILE}"))


def _read(path: Path, missing: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise AdapterFilesError(missing) from e
    except OSError as e:
        raise AdapterFilesError(f"{path.name} cannot be read: {e}") from e


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise AdapterFilesError(f"{CONFIG_FILE} is not JSON: {e}") from e
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterFilesError(f"a {cfg.get('peft_type') if isinstance(cfg, dict) else '?'} adapter, not LoRA")
    if cfg.get("use_dora"):
        raise LoRAAdapterError("DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"adapters that train biases (bias={cfg['bias']!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"modules_to_save {cfg['modules_to_save']} (fully trained modules) are not supported")
    return cfg


def _pattern_value(patterns: Mapping[str, Any], key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first pattern that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.search(rf"(^|\.){pattern}$", key):
            return float(value)
    return default


def parse_adapter(content: AdapterContent, path: str | Path = "") -> AdapterFiles:
    """The modules of an adapter's content (``path``: where it was read from, informational)."""
    cfg = _parse_config(content.config)
    try:
        index, data_start = read_index(content.weights)
    except SafetensorsError as e:
        raise AdapterFilesError(f"{WEIGHTS_FILE} is not a safetensors file: {e}") from e
    try:
        modules = _modules(cfg, index)
    except (TypeError, ValueError, AttributeError, re.error) as e:
        if isinstance(e, LoRAAdapterError):
            raise
        raise LoRAAdapterError(f"{CONFIG_FILE} has a malformed value ({type(e).__name__}: {e})") from e
    base = cfg.get("base_model_name_or_path")
    return AdapterFiles(Path(path), max(m.rank for m in modules), modules, None if base is None else str(base),
                        content, index, data_start)


def _modules(cfg: dict[str, Any], index: Index) -> tuple[AdapterModule, ...]:
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rsl = bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in index:
        m = _KEY.search(key)
        if m is None:
            raise LoRAAdapterError(f"tensor {key!r} is not a LoRA weight of an attention or MLP projection")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
    modules = []
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"layer {layer} {proj} has lora_{''.join(ab)} without its pair")
        r_shape = index[ab["A"]]["shape"]
        name = f"layers.{layer}.{proj}"
        r = int(_pattern_value(cfg.get("rank_pattern") or {}, name, rank))
        a = _pattern_value(cfg.get("alpha_pattern") or {}, name, alpha)
        if r < 1 or not isinstance(r_shape, list) or len(r_shape) != 2 or r_shape[0] != r:
            raise LoRAAdapterError(f"{ab['A']} has shape {r_shape}, expected rank {r} rows")
        modules.append(AdapterModule(layer, proj, r, a / (math.sqrt(r) if rsl else r), ab["A"], ab["B"]))
    if not modules:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return tuple(modules)


def read_adapter(path: str | Path) -> AdapterFiles:
    """Read the PEFT LoRA folder ``path`` whole and parse it (``check_adapter`` checks it against a model)."""
    return parse_adapter(read_content(path), path)


def load_adapter(source: str | Path | AdapterContent, info: ModelInfo, max_lora_rank: int) -> AdapterFiles:
    """An adapter read (from a folder) or taken (content) and checked whole against the model ``info``."""
    files = parse_adapter(source) if isinstance(source, AdapterContent) else read_adapter(source)
    check_adapter(files, info, max_lora_rank)
    return files


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
    ``max_lora_rank``, a projection the model lacks, a layer past its last, shapes of another model, or tensors
    that are not finite float16 / bfloat16 / float32 values filling the file."""
    if adapter.rank > max_lora_rank:
        raise LoRAAdapterError(f"rank {adapter.rank} is over max_lora_rank {max_lora_rank}")
    shapes = projection_shapes(info)
    lacking = sorted(adapter.projections - set(shapes))
    if lacking:
        raise LoRAAdapterError(f"target modules {lacking} are not projections of this {info.model_type} model "
                               f"(it has {sorted(shapes)})")
    for m in adapter.modules:
        if m.layer >= info.num_hidden_layers:
            raise LoRAAdapterError(f"layer {m.layer} is past the model's {info.num_hidden_layers}")
        fan_in, fan_out = shapes[m.projection]
        a, b = adapter.index[m.a_key]["shape"], adapter.index[m.b_key]["shape"]
        if list(a) != [m.rank, fan_in] or list(b) != [fan_out, m.rank]:
            raise LoRAAdapterError(
                f"layer {m.layer} {m.projection} has lora_A {a} and lora_B {b}, but this model needs "
                f"[{m.rank}, {fan_in}] and [{fan_out}, {m.rank}]: an adapter of another base model?")
    try:
        check_tensors(adapter.content.weights, adapter.index, adapter.data_start)
    except TensorError as e:
        raise LoRAAdapterError(str(e)) from e
