"""Attention backends behind one interface (torch reference, Triton, flash-attn)."""

from .backend import AttentionBackend, AttentionMetadata, KVCache, write_kv_cache
from .selector import get_attention_backend
from .torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "TorchAttentionBackend",
    "get_attention_backend",
    "write_kv_cache",
]
