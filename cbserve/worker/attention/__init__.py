"""Attention backends behind one interface (torch reference, CPU C kernel, Triton, flash-attn)."""

from cbserve.worker.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCache,
    write_kv_cache,
)
from cbserve.worker.attention.cpu_backend import CpuAttentionBackend
from cbserve.worker.attention.selector import get_attention_backend
from cbserve.worker.attention.torch_backend import TorchAttentionBackend

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
