"""A model config's attention shape, read one way everywhere (HF configs leave ``head_dim`` and
``num_key_value_heads`` out when they are the plain values)."""

from __future__ import annotations

from typing import Any


def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def num_kv_heads_of(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
