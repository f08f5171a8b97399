"""Engine core: requests, paged KV block management, the iteration-level scheduler. Standard library only."""

from .block_pool import BlockPool, KVBlock
from .config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from .engine_core import EngineCore, StepResult, tune_gc_for_serving
from .errors import DuplicateRequestError, EngineError, QueueFullError, RequestRejectedError
from .kv_cache_manager import KVCacheManager
from .limits import resolve_max_tokens
from .lora import LoRARequest
from .outputs import (
    CachedRequestData,
    Executor,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprob,
)
from .request import EngineRequest, RequestOutput, RequestStatus
from .sampling_params import SamplingParams, StructuredSpec
from .scheduler import Scheduler
from .spec_decode import NgramProposer
from .stats import (
    EngineTotals,
    FinishedRequestStats,
    IterationStats,
    RequestTimes,
    SchedulerStats,
    SpecDecodeStats,
)
from .stop import StopRule

__all__ = [
    "BlockPool",
    "CacheConfig",
    "CachedRequestData",
    "DuplicateRequestError",
    "EngineConfig",
    "EngineCore",
    "EngineError",
    "EngineRequest",
    "EngineTotals",
    "Executor",
    "FinishedRequestStats",
    "IterationStats",
    "KVBlock",
    "KVCacheManager",
    "LoRARequest",
    "ModelRunnerOutput",
    "NgramProposer",
    "NewRequestData",
    "QueueFullError",
    "RequestOutput",
    "RequestRejectedError",
    "RequestStatus",
    "RequestTimes",
    "SamplingParams",
    "StructuredSpec",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SpecDecodeStats",
    "SpeculativeConfig",
    "StepResult",
    "StopRule",
    "TokenLogprob",
    "resolve_max_tokens",
    "tune_gc_for_serving",
]
