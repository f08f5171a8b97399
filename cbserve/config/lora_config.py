"""The LoRA keys of CBServeConfig (vLLM's names): ``lora_modules`` and ``lora_allowed_dirs`` read from every form
users write them in, the checks between the LoRA keys, and the start-up check of every adapter against the model
(read whole without torch: ``worker/lora/files.py``) and of the allowed folders. ``serve_config.py`` declares the
keys; this module holds their rules."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.files import LoRAAdapterError, load_adapter

_FORMS = 'name=path, {"name": ..., "path": ...}, or a mapping of names to paths'


def parse_lora_modules(value: Any) -> dict[str, str] | None:
    """``lora_modules`` as {name: absolute path}: a YAML mapping of names to paths, CLI items ``name=path`` or
    vLLM's JSON ``{"name": ..., "path": ...}`` (one string or a list of them), or a list of such mappings.
    Paths are made absolute here, in the process that reads the configuration: the actors that read the
    adapters run in another working directory. ValueError says what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        value = _json(text) if text.startswith(("{", "[")) else text.split()
        if isinstance(value, dict) and "path" in value:  # one vLLM item
            value = [value]
    if isinstance(value, Mapping):
        items = [_pair(name, path) for name, path in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [_item(v) for v in value]
    else:
        raise ValueError(f"lora_modules: expected {_FORMS}, got {type(value).__name__}")
    modules: dict[str, str] = {}
    for name, path in items:
        if name in modules:
            raise ValueError(f"lora_modules: the adapter name {name!r} is given twice")
        modules[name] = path
    return modules


def _json(text: str, key: str = "lora_modules") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: {text!r} is not valid JSON: {e}") from e


def _item(value: Any) -> tuple[str, str]:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            value = _json(text)
        elif "=" in text:
            return _pair(*text.split("=", 1))
        else:
            raise ValueError(f"lora_modules: expected {_FORMS}, got {value!r}")
    if not isinstance(value, Mapping):
        raise ValueError(f"lora_modules: expected {_FORMS}, got {value!r}")
    unknown = sorted(set(value) - {"name", "path"})
    if unknown or "name" not in value or "path" not in value:
        detail = f"unknown keys {unknown}" if unknown else "it needs both"
        raise ValueError(f"lora_modules: an item has the keys \"name\" and \"path\" ({detail}): {dict(value)}")
    return _pair(value["name"], value["path"])


def _pair(name: Any, path: Any) -> tuple[str, str]:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"lora_modules: an adapter name must be a non-empty string, got {name!r}")
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"lora_modules: the adapter {name!r} needs a path, got {path!r}")
    return name.strip(), os.path.abspath(os.path.expanduser(path.strip()))


def parse_allowed_dirs(value: Any) -> list[str] | None:
    """``lora_allowed_dirs`` as absolute paths: a list of folders, or one string of them (a JSON list, or paths
    apart by whitespace: a flag's or a Serve arg's form). ValueError says what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        value = _json(text, "lora_allowed_dirs") if text.startswith("[") else text.split()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"lora_allowed_dirs: expected a list of folders, got {value!r}")
    return [os.path.abspath(os.path.expanduser(v.strip())) for v in value]


def check_lora_keys(
    enable_lora: bool, lora_modules: Mapping[str, str] | None, max_loras: int, max_cpu_loras: int | None,
    model_name: str, others: Mapping[str, bool], runtime_updating: bool = False,
    allowed_dirs: list[str] | None = None,
) -> None:
    """The LoRA keys agree with each other and with the rest of the configuration: ``others`` names the
    settings LoRA does not combine with and whether they are on. ValueError naming the keys."""
    if lora_modules and not enable_lora:
        raise ValueError("lora_modules needs enable_lora: true (--enable-lora)")
    if runtime_updating and not enable_lora:
        raise ValueError("allow_runtime_lora_updating needs enable_lora: true (--enable-lora)")
    if runtime_updating and not allowed_dirs:
        raise ValueError("allow_runtime_lora_updating needs lora_allowed_dirs, the folders /v1/load_lora_adapter may "
                         "read adapters from (--lora-allowed-dirs DIR ...)")
    if allowed_dirs and not runtime_updating:
        raise ValueError("lora_allowed_dirs needs allow_runtime_lora_updating: true (--allow-runtime-lora-updating): "
                         "without it no adapter is loaded at run time")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
    if enable_lora:
        for key, on in others.items():
            if on:
                raise ValueError(f"enable_lora does not combine with {key}")
    if lora_modules and model_name in lora_modules:
        raise ValueError(f"lora_modules: the adapter name {model_name!r} is the served model's name")


def check_lora_modules(lora_modules: Mapping[str, str] | None, info: ModelInfo, max_lora_rank: int) -> None:
    """Every adapter of ``lora_modules`` can run on the model ``info`` describes (read and checked whole);
    ValueError naming the first one that cannot, its folder and why (not an adapter, a rank over max_lora_rank,
    projections the model lacks, a dtype or values it cannot take...)."""
    for name, path in (lora_modules or {}).items():
        try:
            load_adapter(path, info, max_lora_rank)
        except LoRAAdapterError as e:
            raise ValueError(f"lora_modules: adapter {name!r} at {path}: {e}") from e


def check_allowed_dirs(allowed_dirs: list[str] | None) -> None:
    """Every folder of ``lora_allowed_dirs`` is one (a typo would refuse every load); ValueError names it."""
    for folder in allowed_dirs or ():
        if not os.path.isdir(folder):
            raise ValueError(f"lora_allowed_dirs: {folder} is not a folder")
