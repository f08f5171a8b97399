"""Engine core: requests, paged KV block management, the iteration-level scheduler. Standard library only."""

from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cbserve.scheduler.engine_core import EngineCore, StepResult, tune_gc_for_serving
from cbserve.scheduler.errors import DuplicateRequestError, EngineError, QueueFullError, RequestRejectedError
from cbserve.scheduler.kv.block_pool import BlockPool, KVBlock
from cbserve.scheduler.kv.kv_cache_manager import KVCacheManager
from cbserve.scheduler.outputs import (
    CachedRequestData,
    Executor,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprob,
)
from cbserve.scheduler.requests.limits import resolve_max_tokens
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput, RequestStatus
from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec
from cbserve.scheduler.requests.stop import StopRule
from cbserve.scheduler.scheduler import Scheduler
from cbserve.scheduler.spec_decode import NgramProposer
from cbserve.scheduler.stats import (
    EngineTotals,
    FinishedRequestStats,
    IterationStats,
    RequestTimes,
    SchedulerStats,
    SpecDecodeStats,
)

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
