"""A trainer's LoRA adapter as the bytes a served app checks and runs: the two files of a PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``) made in memory from the adapter's tensors and config, so an
RL loop that trains an adapter pushes it without writing files (``RolloutEngines.load_lora_adapter``; the app's
ingress checks it whole as it checks a folder, ``frontend/lora_registry.py``, and its store hands the bytes to every
worker, ``cluster/stores/lora_store.py``).

    from peft import get_peft_model_state_dict
    content = adapter_content(get_peft_model_state_dict(model), model.peft_config["default"])
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

from cbserve.rl.weight_sync import NamedTensors, named_tensors
from cbserve.worker.lora.files import AdapterContent


def config_dict(config: Any) -> dict[str, Any]:
    """A PEFT ``LoraConfig`` (or a dict of one, as ``adapter_config.json`` holds it) as a JSON-ready dict."""
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(raw, Mapping):
        raise TypeError(f"config must be a peft LoraConfig or a dict of one, got {type(config).__name__}")
    return {str(k): _jsonable(v) for k, v in raw.items()}


def _jsonable(value: Any) -> Any:
    """PEFT's ``save_pretrained`` writes sets as lists and its enums (str subclasses) as their values."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def adapter_content(weights: NamedTensors, config: Any) -> AdapterContent:
    """The adapter's files as bytes: ``weights`` are PEFT's names and tensors (``get_peft_model_state_dict``:
    ``...layers.N.self_attn.q_proj.lora_A.weight``), ``config`` its ``LoraConfig``. Nothing is checked here: the
    app checks the content against its model and answers why it refuses it."""
    from safetensors.torch import save

    tensors = dict(named_tensors(weights))
    body = json.dumps(config_dict(config), indent=2, sort_keys=True).encode()
    return AdapterContent.of(body, save({name: t.clone() for name, t in tensors.items()}))
