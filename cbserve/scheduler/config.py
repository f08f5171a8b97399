"""Frozen configuration of the engine core (scheduler + KV cache manager)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SpecMethod = Literal["ngram", "draft_model"]
SPEC_METHODS = ("ngram", "draft_model")

Policy = Literal["continuous", "prefill_first", "static", "dynamic"]
Ordering = Literal["fcfs", "priority"]
Runner = Literal["generate", "pooling"]
RUNNERS = ("generate", "pooling")


@dataclass(frozen=True)
class OffloadConfig:
    """The KV tiers below the pool (kv/offload.py), in blocks (the worker's half computes them from the GiB the
    operator gave and one block's bytes)."""

    ram_blocks: int
    disk_dir: str | None = None  # this model's folder in the disk tier (the worker names it by the model)
    disk_blocks: int = 0
    # prefill/decode disaggregation (requests/kv_transfer.py): this engine's part ("kv_producer" publishes its RAM
    # tier in shared memory under ``shm_name``, "kv_consumer" pulls from producers', "kv_both" both; None: neither)
    # and how long a producer keeps a request's published blocks for its consumer
    role: str | None = None
    shm_name: str | None = None
    transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.ram_blocks < 1:
            raise ValueError("the RAM tier must hold at least one block (raise kv_offloading_size)")
        if self.disk_dir is not None and self.disk_blocks < 1:
            raise ValueError("the disk tier must hold at least one block (raise kv_disk_size)")


MAX_RETENTION_PRIORITY = 100


@dataclass(frozen=True)
class RetentionLimits:
    max_duration_s: float = 3600.0  # the longest a request may ask
    max_fraction: float = 0.5  # of the pool's blocks retained blocks may hold while free (0: hints are refused)
    cache_control_priority: int = 50  # the priority of a chat message's ``cache_control``

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_fraction <= 1.0:
            raise ValueError(f"kv_retention_max_fraction must be within [0, 1], got {self.max_fraction}")
        if self.max_duration_s <= 0:
            raise ValueError(f"kv_retention_max_duration_s must be positive, got {self.max_duration_s}")
        if not 1 <= self.cache_control_priority <= MAX_RETENTION_PRIORITY:
            raise ValueError(f"kv_retention_cache_control_priority must be within 1..{MAX_RETENTION_PRIORITY}")

    @property
    def enabled(self) -> bool:
        return self.max_fraction > 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024  # set from the worker's memory profile before the engine starts
    enable_prefix_caching: bool = True
    offload: OffloadConfig | None = None  # KV tiers below the pool (kv/offload.py)
    retention: RetentionLimits = RetentionLimits()  # what retention hints may ask (kv/retention.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be positive")
        if self.offload is not None and not self.enable_prefix_caching:
            raise ValueError("KV tiers keep prefix-cache blocks: they need enable_prefix_caching")


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
    # LoRA: at most this many distinct adapters in one step (0: LoRA off, requests naming one are refused)
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and max_model_len must be positive")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's shape: ``{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}``. N-gram (prompt lookup): the longest suffix of a
    sequence's tokens, of a..b tokens, found earlier in its prompt + output proposes the k tokens that
    followed it (spec_decode.py). ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``:
    a smaller model sharing the target's vocabulary proposes k tokens autoregressively on the worker
    (worker/runner/draft_model.py); the worker returns them with its output and the scheduler schedules them."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # no drafts in a step while more sequences than this run (a big CPU batch is compute-bound: drafts cost
    # more than they save); None: always draft
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft's folder or GGUF file

    def __post_init__(self) -> None:
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError('speculative_config: method "draft_model" needs "model" (the draft model\'s path)')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'speculative_config: "model" is only for method "draft_model", not {self.method!r}')
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; expected one of {SPEC_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive integer, got {limit!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative_config: prompt_lookup_max ({self.prompt_lookup_max}) must be >= "
                f"prompt_lookup_min ({self.prompt_lookup_min})"
            )

    @classmethod
    def from_dict(cls, data: dict[str, object] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the user's mapping; unknown keys (those of the other method too) are refused."""
        if data is None or isinstance(data, SpeculativeConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(data).__name__}")
        if "method" not in data or "num_speculative_tokens" not in data:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        known = {"method", "num_speculative_tokens", "disable_by_batch_size"}
        known |= {"model"} if data.get("method") == "draft_model" else {"prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} for method {data.get('method')!r}")
        kw = dict(data)
        if "prompt_lookup_max" in kw and "prompt_lookup_min" not in kw:
            kw["prompt_lookup_min"] = min(cls.prompt_lookup_min, kw["prompt_lookup_max"])  # type: ignore[call-overload]
        if "prompt_lookup_min" in kw and "prompt_lookup_max" not in kw:
            kw["prompt_lookup_max"] = max(cls.prompt_lookup_max, kw["prompt_lookup_min"])  # type: ignore[call-overload]
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    speculative: SpeculativeConfig | None = None
    # "pooling": every request is a prompt to embed (computed, pooled by the worker, finished with its vector)
    runner: Runner = "generate"

    def __post_init__(self) -> None:
        if self.speculative is not None and self.scheduler.async_scheduling:
            raise ValueError("speculative decoding does not combine with async_scheduling: turn one off")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.runner == "pooling" and (self.cache.enable_prefix_caching or self.speculative is not None):
            # a prefix-cache hit would skip tokens whose hidden states the pooling needs
            raise ValueError("runner 'pooling' needs enable_prefix_caching off and no speculative decoding")
