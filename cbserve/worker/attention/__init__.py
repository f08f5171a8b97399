"""Attention backends behind one interface (torch reference, CPU C kernel, Triton, flash-attn)."""

from .backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    write_kv_cache,
)
from .cpu_backend import CpuAttentionBackend
from .selector import get_attention_backend
from .torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionLayout",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "CpuAttentionBackend",
    "KVCache",
    "TorchAttentionBackend",
    "get_attention_backend",
    "write_kv_cache",
]
