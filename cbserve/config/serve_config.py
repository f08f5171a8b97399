"""The one user-facing configuration of cbserve (pydantic), read from YAML, CLI flags, a Serve app's ``args``
or ``LLM(**fields)`` offline, and turned into the frozen dataclasses the engine (``engine_config``) and the
workers (``worker_model_config``) use: a value is checked here, once. ``servable.py`` adds the checks that
need the model (its heads, context length, KV size), read without torch; ``offline.py`` the fields that only
make sense served. Importable without ray: ``cluster/`` and the front end both read it."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cbserve.config.autoscaling import parse_autoscaling
from cbserve.config.kv_config import check_tier_keys, merge_kv_transfer
from cbserve.config.lora_config import check_lora_keys, parse_allowed_dirs, parse_lora_modules
from cbserve.config.pd_config import PDConfig, apply_layout, check_pd_keys, worker_fields
from cbserve.config.sim_config import check_sim_keys
from cbserve.config.sources import read_yaml
from cbserve.scheduler.config import (
    CacheConfig,
    EngineConfig,
    OffloadConfig,
    RetentionLimits,
    SchedulerConfig,
    SpeculativeConfig,
)
from cbserve.worker.config import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    AttentionBackendName,
    CpuDecodeActivations,
    CpuIsaName,
    CpuOpsName,
    CudaGraphMode,
    Device,
    Dtype,
    KvCacheDtype,
    ModelConfig,
    QuantizationName,
    fp8_conflict,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# how requests are spread over the engine replicas (cluster/ingress/router.py)
RoutingMode = Literal["cache_aware", "affinity", "round_robin"]
ROUTING_MODES: tuple[str, ...] = get_args(RoutingMode)


def connected_ray() -> Any | None:
    """The ray module when this process is connected to a Ray cluster, else None. Looked up, never imported: a
    process that has not imported ray is connected to no cluster (and the offline path stays without ray)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


class ConfigError(ValueError):
    """A configuration that can never serve (one message, naming the values that disagree)."""


class CBServeConfig(BaseModel):
    """Everything needed to serve one model. Unknown keys are an error (typos do not pass silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None  # HF folder or GGUF path; None = the bundled SmolLM2 GGUF; "sim": config/sim_config.py
    served_model_name: str | None = None  # name clients use in "model"; default from the model
    dtype: Dtype = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: Device = "auto"  # cuda when the Ray cluster has a GPU, else cpu
    cpu_ops: CpuOpsName = "auto"  # CPU kernels (worker/cpu/)
    cpu_isa: CpuIsaName = "auto"  # which build of the C kernels: avx512, avx2, scalar; auto = the CPU's best
    cpu_compact_weights: bool = True  # native CPU kernels read exact compact weights
    # "int16": 4-8-bit GGUF weights multiply rows rounded to int16 (native CPU kernels): decode steps', every step's;
    cpu_decode_activations: CpuDecodeActivations = "auto"  # "auto": int16 where the CPU has VNNI and the weights are
    cpu_prefill_activations: CpuDecodeActivations = "auto"  # such blocks, else float32 (exact); see worker/config.py
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA-graph capture of decode steps
    # CUDA: "full_and_piecewise" also replays steps with prefill chunks (<= 512 tokens) from piecewise graphs
    cudagraph_mode: CudaGraphMode = "full_decode_only"
    # FP8, vLLM's names (CUDA compute capability 8.9+; on CPU an emulation for accuracy checks, on the torch ops):
    # "fp8" quantizes the linear weights to e4m3 at load (a scale per output channel, activations per token)
    quantization: QuantizationName | None = None
    kv_cache_dtype: KvCacheDtype = "auto"  # "fp8" / "fp8_e4m3": e4m3 KV with a scale per token and head
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)  # data-parallel engine replicas
    seed: int = 0
    # "pooling": the model embeds (/v1/embeddings) instead of generating; pooling from its sentence-transformers
    # files (worker/loading/pooling_config.py); no prefix caching (a hit would skip tokens the pooling needs)
    runner: Literal["generate", "pooling"] = "generate"
    block_size: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    max_model_len: int = Field(2048, ge=1)  # unset: at most the model's max_position_embeddings
    kv_cache_memory_bytes: int = Field(DEFAULT_KV_CACHE_MEMORY_BYTES, ge=1)  # KV budget per worker on CPU
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_kv_blocks: int | None = Field(None, ge=1)  # force the block count (skips memory profiling)
    policy: Literal["continuous", "prefill_first", "static", "dynamic"] = "continuous"
    ordering: Literal["fcfs", "priority"] = "fcfs"  # "priority": requests' ``priority`` orders them (lower first)
    enable_prefix_caching: bool = True
    # KV tiers below the pool (scheduler/kv/offload.py): a RAM tier of this many GiB (vLLM's --kv-offloading-size;
    # "native" its one backend), a disk tier of this many GiB in a folder the replicas of a node share
    kv_offloading_size: float | None = Field(None, gt=0)
    kv_offloading_backend: Literal["native"] = "native"
    kv_offloading_dtype: Literal["auto", "bfloat16", "int8"] = "auto"  # half / a quarter a float32 cache's bytes, lossy
    kv_disk_path: str | None = None
    kv_disk_size: float | None = Field(None, gt=0)
    kv_transfer_config: dict[str, Any] | None = None  # vLLM's JSON of the same (config/kv_config.py)
    # prefill/decode disaggregation (config/pd_config.py): a P:D app (--pd P:D) or this server's kv_role
    disaggregation: PDConfig | None = None
    # retention hints (scheduler/kv/retention.py): the longest a request may ask, the share of the pool and tiers
    # hinted free blocks may hold (0: hints refused), the priority of cache_control and prompt_cache_retention
    kv_retention_max_duration_s: float = Field(3600.0, gt=0)
    kv_retention_max_fraction: float = Field(0.5, ge=0.0, le=1.0)
    kv_retention_cache_control_priority: int = Field(50, ge=1, le=100)
    enable_chunked_prefill: bool = True  # off: a prompt longer than the step's token budget waits for a step of its own
    dynamic_batch_window_s: float = Field(0.05, ge=0.0)  # policy "dynamic": collect requests for this long...
    dynamic_batch_size: int = Field(32, ge=1)  # ...or until this many wait, then run them as a static batch
    max_waiting: int = Field(4096, ge=0)
    # schedule the next step while the current one runs (the hop and the scheduler's work overlap the forward)
    async_scheduling: bool = True
    # speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", "model": PATH,
    # "num_speculative_tokens": k} (same tokenizer); turns async scheduling off (they do not combine yet)
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (vLLM's keys, config/lora_config.py): a request whose "model" names an adapter runs with it
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None  # name -> PEFT folder, served from the start (needs enable_lora)
    max_loras: int = Field(1, ge=1)  # distinct adapters in one step (the workers' adapter slots)
    max_lora_rank: int = Field(16, ge=1, le=512)  # the largest rank an adapter may have (vLLM's limit: 512)
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters a worker keeps loaded (unset: max_loras)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter: off unless set (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING);
    # the adapters they load must lie under one of lora_allowed_dirs
    allow_runtime_lora_updating: bool = False
    lora_allowed_dirs: list[str] | None = None
    # sleep / wake_up (an RL loop's, vLLM's --enable-sleep-mode): the KV cache (level 1) and the weights (level 2) go
    # back to the system until wake_up; off: sleep is refused
    enable_sleep_mode: bool = False
    # Ray placement and execution
    # CPUs per tensor-parallel rank: a worker actor's (one bundle per rank), or the engine actor's at TP=1
    worker_num_cpus: float = Field(1.0, gt=0.0)
    # torch / C-kernel threads in each worker; unset: on CPU, the node's cores shared by its ranks (Ray would
    # otherwise give an actor with num_cpus=1 one thread); on CUDA, torch's default
    worker_torch_threads: int | None = Field(None, ge=1)
    # the scheduler -> workers hop: a Ray compiled graph (~0.2 ms, but its reader busy-polls a core while a
    # step runs) or one socket per rank (cluster/channel/steps.py, ~0.3 ms of CPU a step); "auto": the
    # compiled graph on CUDA only, where no core is taken from the model's compute
    use_compiled_graph: bool | Literal["auto"] = "auto"
    # Ray restarts of an engine replica's actor (-1: always); at tensor_parallel_size 1 its rank runs in it, so a
    # request that kills its process (or the OOM killer) uses one
    max_restarts: int = Field(-1, ge=-1)
    # routing between replicas
    prefix_affinity_tokens: int = Field(64, ge=0)  # tokens hashed for prefix affinity (block aligned)
    affinity_max_imbalance_tokens: int = Field(4096, ge=0)  # stay on the preferred replica unless this
    # many more outstanding tokens than the least loaded one
    # cache_aware: the replica whose prefix cache holds the longest prefix (the engines report their cached blocks);
    # affinity: prefix affinity and load only; round_robin: in turn (cluster/ingress/router.py)
    routing: RoutingMode = "cache_aware"
    # HTTP
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    route_prefix: str = "/"
    app_name: str = "cbserve"
    api_key: str | None = None
    max_n: int = Field(16, ge=1)  # largest n (or best_of) a request may ask for
    # tool_choice "auto": the model's tool-call format ("auto": from its chat template; "none": refused)
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json"] = "auto"
    # reasoning models: chat answers' <think> text goes to reasoning_content (frontend/tools/reasoning.py);
    # "auto": from the chat template when it is unambiguous; "none" (or null): off
    reasoning_parser: Literal["none", "auto", "qwen3", "deepseek_r1"] | None = "none"
    # structured JSON in one fixed layout ({"a": 1, "b": [2, 3]}); false: any whitespace between its tokens
    # (vLLM's default); a request's structured_outputs.disable_any_whitespace overrides it
    disable_any_whitespace: bool = True
    request_timeout_s: float | None = Field(None, gt=0.0)  # a longer request is aborted (HTTP 504)
    node_tuning: Literal["engine-first", "off"] = "engine-first"  # the node's CPU for the engine (node_tuning.py)
    # on SIGTERM / Ctrl-C and on an ingress replica's shutdown: seconds requests in flight get to finish (new ones
    # get 503 meanwhile) before the rest are aborted
    shutdown_timeout: float = Field(20.0, ge=0.0)
    # /v1/responses with store: true: responses kept for the whole app (every ingress replica), at most this many
    # (the least recently used out first), each for at most this long
    responses_store_max_entries: int = Field(1024, ge=1)
    responses_store_ttl_s: float = Field(3600.0, gt=0.0)
    # ingress replicas (each with its num_replicas engines) on Serve's autoscaler: "min=1,max=4,target_ongoing=2"
    # or Serve's autoscaling_config; min 0 scales to zero (config/autoscaling.py); unset: one ingress replica
    autoscaling: dict[str, Any] | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _check_speculative(cls, value: Any) -> Any:
        if isinstance(value, str):  # from a CLI flag or a Serve arg: JSON
            value = _none_if_null(value)
            if value is not None:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        SpeculativeConfig.from_dict(value)  # unknown method, keys or bad values raise here
        return value

    @model_validator(mode="before")
    @classmethod
    def _kv_transfer(cls, values: Any) -> Any:
        return apply_layout(merge_kv_transfer(values))

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _parse_autoscaling(cls, value: Any) -> dict[str, Any] | None:
        return parse_autoscaling(value)

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> dict[str, str] | None:
        return parse_lora_modules(_none_if_null(value))

    @field_validator("lora_allowed_dirs", mode="before")
    @classmethod
    def _parse_allowed_dirs(cls, value: Any) -> list[str] | None:
        return parse_allowed_dirs(_none_if_null(value))

    @model_validator(mode="after")
    def _check(self) -> CBServeConfig:
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be >= block_size")
        if not self.route_prefix.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ValueError("runner 'pooling' does not combine with speculative_config (nothing is generated)")
        draft = self.speculative_config is not None and self.speculative_config.get("method") == "draft_model"
        check_lora_keys(self.enable_lora, self.lora_modules, self.max_loras, self.max_cpu_loras, self.model_name,
                        {"runner 'pooling'": self.runner == "pooling", "a draft model (speculative_config)": draft},
                        self.allow_runtime_lora_updating, self.lora_allowed_dirs)
        check_sim_keys(self)
        if self.use_compiled_graph is True and self.tensor_parallel_size == 1:
            raise ValueError("use_compiled_graph applies to tensor_parallel_size > 1: a replica of one rank runs it in "
                             "its engine actor (cluster/engine/rank.py), with no step hop to compile")
        check_tier_keys(self)
        check_pd_keys(self)
        fp8 = fp8_conflict(self.quantization, self.kv_cache_dtype, self.attention_backend, self.device, self.cpu_ops)
        if fp8 is not None:
            raise ValueError(fp8)
        return self

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **overrides: Any) -> CBServeConfig:
        """Read a YAML mapping of the fields above (or a Serve config whose first app has ``args``)."""
        return cls.model_validate(read_yaml(path, overrides))

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> CBServeConfig:
        """Serve app args (``serve run ... key=value`` gives strings; pydantic coerces them). A ``config``
        key names a YAML file whose values the other keys override."""
        args = {k.replace("-", "_"): _none_if_null(v) for k, v in (args or {}).items()}
        path = args.pop("config", None)
        if path:
            return cls.from_yaml(path, **args)
        return cls.model_validate({k: v for k, v in args.items() if v is not None})

    # ---- derived ------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        return Path(self.model.rstrip("/")).name.removesuffix(".gguf")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        ray = connected_ray()
        if ray is not None:  # the cluster decides: an actor that asked for no GPU sees none itself
            return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover - torch is a hard dependency of the workers
            return "cpu"

    @property
    def compiled_graph(self) -> bool:
        """Whether the scheduler reaches its workers through a Ray compiled graph (``use_compiled_graph``; a replica
        of one rank has no worker actor to reach)."""
        if self.tensor_parallel_size == 1:
            return False
        if self.use_compiled_graph == "auto":
            return self.resolved_device == "cuda"
        return self.use_compiled_graph

    def worker_threads(self, num_cores: int) -> int | None:
        """Threads for one worker rank on a node of ``num_cores`` cores (None: leave torch's default)."""
        if self.worker_torch_threads is not None:
            return self.worker_torch_threads
        if self.resolved_device == "cuda":
            return None
        return max(1, num_cores // self.tensor_parallel_size)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def uses_kv_events(self) -> bool:
        """Whether the engines report their prefix-cache blocks (only a cache-aware router reads them)."""
        return self.routing == "cache_aware"

    @property
    def uses_async_scheduling(self) -> bool:
        """async_scheduling, unless speculative decoding is on (they do not combine yet)."""
        return self.async_scheduling and self.speculative_config is None

    def engine_config(self, num_blocks: int, offload: OffloadConfig | None = None) -> EngineConfig:
        """``offload``: the KV tiers' sizes in blocks, from the worker that holds them (``KVTiers.config``)."""
        if self.async_scheduling and self.speculative_config is not None:
            logger.info("speculative_config is set: the engine runs without async scheduling")
        pooling = self.runner == "pooling"
        if pooling and self.enable_prefix_caching:
            logger.info("runner 'pooling': the engine runs without prefix caching (the pooling needs every "
                        "token's hidden state)")
        return EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                policy=self.policy,
                ordering=self.ordering,
                enable_chunked_prefill=self.enable_chunked_prefill,
                dynamic_batch_window_s=self.dynamic_batch_window_s,
                dynamic_batch_size=self.dynamic_batch_size,
                max_waiting=self.max_waiting,
                async_scheduling=self.uses_async_scheduling,
                max_loras=self.max_loras if self.enable_lora else 0,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=self.enable_prefix_caching and not pooling,
                offload=offload,
                retention=RetentionLimits(self.kv_retention_max_duration_s, self.kv_retention_max_fraction,
                                          self.kv_retention_cache_control_priority),
            ),
            speculative=self.speculative,
            runner=self.runner,
        )

    def worker_model_config(self, rank: int = 0) -> ModelConfig:
        """The worker's frozen ModelConfig of one tensor-parallel rank."""
        return ModelConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.resolved_device,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            cudagraph_mode=self.cudagraph_mode,
            cpu_ops=self.cpu_ops,
            cpu_isa=self.cpu_isa,
            cpu_compact_weights=self.cpu_compact_weights,
            cpu_decode_activations=self.cpu_decode_activations,
            cpu_prefill_activations=self.cpu_prefill_activations,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            rank=rank,
            runner=self.runner,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_offloading_bytes=int((self.kv_offloading_size or 0) * 2**30),
            kv_offloading_dtype=self.kv_offloading_dtype,
            kv_disk_path=self.kv_disk_path,
            kv_disk_bytes=int((self.kv_disk_size or 0) * 2**30),
            **self._draft_fields(),
            **worker_fields(self.disaggregation),
        )

    def _draft_fields(self) -> dict[str, Any]:
        spec = self.speculative
        if spec is None or spec.method != "draft_model":
            return {}
        return {"draft_model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens}


def _none_if_null(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in {"none", "null", ""}:
        return None
    return value
