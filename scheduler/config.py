"""Frozen configuration of the engine core (scheduler + KV cache manager)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["continuous", "prefill_first", "static", "dynamic"]
Ordering = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024  # set from the worker's memory profile before the engine starts
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per iteration
    max_num_seqs: int = 128  # sequence cap per iteration
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    policy: Policy = "continuous"
    ordering: Ordering = "fcfs"
    enable_chunked_prefill: bool = True
    max_waiting: int = 4096  # bounded waiting queue; past it, add_request raises QueueFullError
    dynamic_batch_window_s: float = 0.05  # "dynamic" policy: collect for this long...
    dynamic_batch_size: int = 32  # ...or until this many requests wait, then run them like static
    # Schedule step N+1 before step N's sampled tokens are back (the driver overlaps the hop and its own
    # work with the forward): a sequence sampled in a step still in flight gets one more decode token,
    # whose id the worker fills in from its own sample. See Scheduler._commit.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_model_len must be positive")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
