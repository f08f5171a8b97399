"""The attention backend interface and the per-iteration metadata every backend receives.

The model runner owns a step's attention plan, as vLLM V1 does: each backend class makes an
``AttentionMetadataBuilder`` for the model's ``AttentionLayout`` (``AttentionBackend.make_builder``; the
model says which backend class and layout it was built with, ``CausalLM.attention_backend`` and
``attention_layout``), the runner creates it once and, before each forward pass, sets
``metadata.prepared = builder.build(metadata)``. The plan is a small dataclass of the backend's own
(``TorchPrepared``, ``CpuPrepared``, ``TritonPrepared``, ``FlashPrepared``, all ``PreparedAttention``),
built once per step and read by every layer; a backend's ``forward`` only reads it and raises
RuntimeError when the step has none of its type. A builder may hold scratch memory its plans lend the
layers (the torch backend's gather buffer), never request state.

The model runner orders the requests of an iteration decode-first: the first ``num_decodes`` requests
have exactly one query token each (rows ``0..num_decodes-1`` of the flattened batch); the rest are
prefill chunks (any number of query tokens, possibly continuing a prefix already in the cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from cbserve.worker.attention.kv_fp8 import Fp8KVCache, write_fp8

# (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]; with kv_cache_dtype "fp8" an Fp8KVCache (kv_fp8.py)
KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PreparedAttention:
    """Base of the per-step plan a backend's builder computes once for all layers."""


@dataclass(frozen=True)
class AttentionLayout:
    """What a backend's metadata builder needs to know of the model: the attention heads of this rank (after
    tensor parallelism), the head size, and the dtype and device of its activations and KV cache."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


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
    # The step's plan, set by the model runner from its backend's builder (its own PreparedAttention subclass).
    prepared: PreparedAttention | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionMetadataBuilder(ABC):
    """Builds a backend's per-step plan from the step's metadata; made once per model by the model runner
    (``AttentionBackend.make_builder``)."""

    def __init__(self, layout: AttentionLayout) -> None:
        self.layout = layout

    @abstractmethod
    def build(self, md: AttentionMetadata) -> PreparedAttention:
        """This step's plan for every layer (the caller stores it in ``md.prepared``)."""


class AttentionBackend(ABC):
    """One attention implementation over the paged KV cache, one instance per layer. Holds the layer's
    configuration only; the step's plan comes from the backend's builder, in ``metadata.prepared``."""

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

    @classmethod
    @abstractmethod
    def make_builder(cls, layout: AttentionLayout) -> AttentionMetadataBuilder:
        """The builder of this backend's per-step plans for a model of ``layout``."""

    @classmethod
    def missing_plan(cls, md: AttentionMetadata, plan_type: type) -> RuntimeError:
        """The error a layer raises when ``md`` carries no plan of ``plan_type`` (``forward`` never builds one)."""
        got = type(md.prepared).__name__ if md.prepared is not None else "none"
        return RuntimeError(
            f"attention backend {cls.name!r} needs the step's {plan_type.__name__} in metadata.prepared (got "
            f"{got}): the model runner must build it with the backend's builder first "
            f"(metadata.prepared = {cls.__name__}.make_builder(layout).build(metadata))"
        )

    plan_type: type = PreparedAttention  # the type of the plans its builder makes

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write k/v into the cache at ``metadata.slot_mapping``, then attend with the step's plan,
        ``metadata.prepared`` (RuntimeError without one of this backend's ``plan_type``); returns
        [num_tokens, num_heads, head_dim]."""
        p = metadata.prepared
        if not isinstance(p, self.plan_type):
            raise self.missing_plan(metadata, self.plan_type)
        return self.attend(q, k, v, kv_cache, metadata, p)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, md: AttentionMetadata,
               p: Any) -> torch.Tensor:
        """``forward`` with the step's plan checked: this backend's own work."""


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter this iteration's keys/values into their cache slots (quantized, for an FP8 cache)."""
    if isinstance(kv_cache, Fp8KVCache):
        write_fp8(k, v, kv_cache, slot_mapping)
        return
    k_cache, v_cache = kv_cache
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)
