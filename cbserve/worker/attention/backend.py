"""The attention backend interface and the per-iteration metadata every backend receives.

Each backend turns the metadata into what its kernels need once per step, in ``prepare()`` (the model
runner calls it on layer 0's backend before the forward pass); the result, a small dataclass of the
backend's own (``TorchPrepared``, ``CpuPrepared``, ``TritonPrepared``, ``FlashPrepared``, all
``PreparedAttention``), is stored in ``metadata.prepared`` and read by every layer.

The model runner orders the requests of an iteration decode-first: the first ``num_decodes`` requests
have exactly one query token each (rows ``0..num_decodes-1`` of the flattened batch); the rest are
prefill chunks (any number of query tokens, possibly continuing a prefix already in the cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class PreparedAttention:
    """Base of the per-step data a backend's ``prepare()`` computes once for all layers."""


@dataclass
class AttentionMetadata:
    """Attention inputs of one iteration, built once by the model runner and shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block_id * block_size + offset) per token
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this iteration's tokens
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: row offsets of each request's query tokens
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host-side copies for backends that loop in Python (no device sync needed).
    query_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # The decode kernel's split count, fixed by a CUDA-graph runner for the life of a captured graph (the
    # Triton backend's launch constant); None: the backend picks it per step.
    decode_num_splits: int | None = None
    # What the backend's prepare() computed for this step (its own PreparedAttention subclass).
    prepared: PreparedAttention | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache. Holds its configuration and, at most, scratch
    buffers reused between steps (never request state)."""

    name: str = "abstract"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive or None, got {softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # This layer's query at position p attends to keys max(0, p - sliding_window + 1)..p (the last
        # ``sliding_window`` tokens, as HF's sliding-window mask); None: to every earlier key.
        self.sliding_window = sliding_window
        # Attention logits are soft-capped before the softmax (Gemma 2): s -> softcap * tanh(s / softcap).
        self.softcap = softcap

    @abstractmethod
    def prepare(self, metadata: AttentionMetadata) -> PreparedAttention:
        """Compute this step's per-iteration data (once per step, not per layer), store it in
        ``metadata.prepared`` and return it."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write k/v into the cache at ``metadata.slot_mapping``, then attend; returns
        [num_tokens, num_heads, head_dim]."""


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter this iteration's keys/values into their cache slots."""
    k_cache, v_cache = kv_cache
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)
