"""The KV tiers' configuration keys: vLLM's ``--kv-transfer-config`` JSON read into cbserve's own keys
(``kv_transfer_fields``), and what the tiers refuse to combine with (``check_tier_keys``).

cbserve has one connector, vLLM's ``OffloadingConnector`` shape (scheduler/kv/connector.py, offload.py): a RAM tier
below the pool and optionally a disk tier. Its JSON, as vLLM's:

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes_to_use": 4000000000, "block_size": 16}}

``cpu_bytes_to_use`` is ``kv_offloading_size`` in bytes; ``block_size``, when given, must be the engine's (the tiers
hold the pool's blocks); cbserve's own ``disk_path`` and ``disk_bytes_to_use`` give the disk tier, and ``dtype``
("auto", "bfloat16" or "int8") is ``kv_offloading_dtype``. ``kv_role`` "kv_producer" or "kv_consumer" makes this
server one side of prefill/decode disaggregation driven by a proxy (``disaggregation.kv_role``: pd_config.py; the
RAM tier is then the shared-memory hand-off); "kv_both" is the tiers alone. Any other connector (NIXL, LMCache),
role or key is refused with a ValueError naming it; so is a key set both here and on its own to another value.
"""

from __future__ import annotations

import json
from typing import Any

from cbserve.worker.config import tier_conflict

CONNECTOR = "OffloadingConnector"
ROLES = ("kv_both", "kv_producer", "kv_consumer")
_EXTRA = {"cpu_bytes_to_use": "kv_offloading_size", "disk_bytes_to_use": "kv_disk_size", "disk_path": "kv_disk_path",
          "dtype": "kv_offloading_dtype", "block_size": "block_size", "spec_name": None}  # fmt: skip
_GIB = {"cpu_bytes_to_use", "disk_bytes_to_use"}


def _as_dict(raw: Any) -> dict[str, Any]:
    if isinstance(raw, str):  # a CLI flag or a Serve arg: JSON
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_config must be a JSON object, got {type(raw).__name__}")
    return raw


def kv_transfer_fields(raw: Any) -> dict[str, Any]:
    """cbserve's config keys that ``kv_transfer_config`` (a dict or its JSON) stands for."""
    cfg = _as_dict(raw)
    unknown = sorted(set(cfg) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}")
    if cfg.get("kv_connector") != CONNECTOR:
        raise ValueError(f"kv_transfer_config: kv_connector {cfg.get('kv_connector')!r} is not supported; cbserve's "
                         f"one connector is {CONNECTOR!r} (KV tiers below the pool)")
    role = cfg.get("kv_role", "kv_both")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config: kv_role {role!r} is not one of {list(ROLES)}")
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict) or set(extra) - set(_EXTRA):
        raise ValueError(f"kv_transfer_config: kv_connector_extra_config takes {sorted(_EXTRA)}, got {extra!r}")
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        raise ValueError(f"kv_transfer_config: spec_name {extra['spec_name']!r} is not supported (cbserve's disk "
                         "tier is disk_path and disk_bytes_to_use)")
    if "cpu_bytes_to_use" not in extra:
        raise ValueError("kv_transfer_config: kv_connector_extra_config needs cpu_bytes_to_use (the RAM tier)")
    out: dict[str, Any] = {} if role == "kv_both" else {"disaggregation": {"kv_role": role}}
    for key, value in extra.items():
        field = _EXTRA[key]
        if field is not None:
            out[field] = _number(key, value) / 2**30 if key in _GIB else value
    return out


def _number(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"kv_transfer_config: {key} must be a number, got {value!r}") from e


def merge_kv_transfer(values: Any) -> Any:
    """A config's raw values with ``kv_transfer_config`` read into cbserve's keys (a key set on its own to another
    value: ValueError)."""
    if not isinstance(values, dict) or values.get("kv_transfer_config") in (None, "", "null", "none"):
        return values
    fields = kv_transfer_fields(values["kv_transfer_config"])
    clash = [k for k, v in fields.items() if values.get(k) is not None and k not in ("block_size", "disaggregation")
             and not _same(values[k], v)]  # fmt: skip
    if "disaggregation" in fields and values.get("disaggregation") not in (None, "", "none", "null"):
        clash.append("disaggregation")
    if clash:
        raise ValueError(f"kv_transfer_config and {clash} both set the KV tiers: give one")
    size = fields.pop("block_size", None)
    if size is not None and int(values.get("block_size") or 16) != int(size):
        raise ValueError(f"kv_transfer_config: block_size {size} must be the engine's block_size "
                         f"({values.get('block_size') or 16}): the tiers hold the pool's blocks")
    return {**values, **fields, "kv_transfer_config": None}


def _same(given: Any, value: Any) -> bool:
    """A key set on its own (a CLI flag or Serve arg gives a string) equal to what the JSON says."""
    if isinstance(value, float):
        try:
            return float(given) == value
        except (TypeError, ValueError):
            return False
    return str(given) == str(value)


def check_tier_keys(config: Any) -> None:
    """ValueError where the KV tiers' keys (of a ``CBServeConfig``) cannot run as asked."""
    draft_model = config.speculative_config is not None and config.speculative_config.get("method") == "draft_model"
    tiers = tier_conflict(config.kv_offloading_size, config.kv_disk_path, config.kv_disk_size,
                          {"enable_prefix_caching off": not config.enable_prefix_caching,
                           "runner 'pooling'": config.runner == "pooling", "kv_cache_dtype fp8": "fp8" in
                           config.kv_cache_dtype, "a draft model": draft_model,
                           "tensor_parallel_size > 1": config.tensor_parallel_size > 1})  # fmt: skip
    if tiers is not None:
        raise ValueError(tiers)
    if config.kv_offloading_dtype != "auto" and not config.kv_offloading_size:
        raise ValueError("kv_offloading_dtype applies to the KV tiers: set kv_offloading_size too")
