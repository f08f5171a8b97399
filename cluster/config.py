"""The one user-facing configuration of a cbserve deployment (pydantic), read from YAML, CLI flags or a
Serve app's ``args``, and turned into the frozen dataclasses the engine and the workers use."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class CBServeConfig(BaseModel):
    """Everything needed to serve one model. Unknown keys are an error (typos do not pass silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # model
    model: str | None = None  # HF folder or GGUF path; None = the bundled SmolLM2-135M-Instruct GGUF
    served_model_name: str | None = None  # name clients use in "model"; default from the model
    dtype: str = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cpu_ops: Literal["auto", "native", "onednn", "torch"] = "auto"  # CPU kernels (see worker/cpu_ops.py)
    cpu_compact_weights: bool = True  # native CPU kernels read exact compact weights (worker/cpu_linear.py)
    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)  # data-parallel engine replicas
    seed: int = 0
    # engine
    block_size: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    max_model_len: int = Field(2048, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)  # CPU KV budget per worker; None = worker default
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_kv_blocks: int | None = Field(None, ge=1)  # force the block count (skips memory profiling)
    policy: Literal["continuous", "prefill_first", "static", "dynamic"] = "continuous"
    enable_prefix_caching: bool = True
    max_waiting: int = Field(4096, ge=0)
    # Ray placement and execution
    worker_num_cpus: float = Field(1.0, gt=0.0)  # CPUs per worker actor (one bundle per TP rank)
    worker_torch_threads: int | None = Field(None, ge=1)  # torch.set_num_threads in each worker
    use_compiled_graph: bool = True  # Ray compiled graph for the scheduler -> workers hop
    max_restarts: int = Field(3, ge=-1)  # Ray restarts of a scheduler actor
    # routing between replicas
    prefix_affinity_tokens: int = Field(64, ge=0)  # tokens hashed for prefix affinity (block aligned)
    affinity_max_imbalance_tokens: int = Field(4096, ge=0)  # stay on the preferred replica unless this
    # many more outstanding tokens than the least loaded one
    # HTTP
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=0, le=65535)
    route_prefix: str = "/"
    app_name: str = "cbserve"
    api_key: str | None = None
    max_n: int = Field(16, ge=1)  # largest n (or best_of) a request may ask for
    request_timeout_s: float | None = None

    @model_validator(mode="after")
    def _check(self) -> CBServeConfig:
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be >= block_size")
        if not self.route_prefix.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        return self

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **overrides: Any) -> CBServeConfig:
        """Read a YAML mapping of the fields above (or a Serve config whose first app has ``args``)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
        if "applications" in data:  # a Serve config file: take the first application's args
            apps = data["applications"] or [{}]
            data = dict(apps[0].get("args") or {})
        data.pop("config", None)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

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
        import ray

        if ray.is_initialized():  # the cluster decides: an actor that asked for no GPU sees none itself
            return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover - torch is a hard dependency of the workers
            return "cpu"

    def engine_config(self, num_blocks: int) -> EngineConfig:
        return EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len,
                policy=self.policy,
                max_waiting=self.max_waiting,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
        )

    def worker_model_config(self, rank: int = 0) -> Any:
        """The worker's frozen ModelConfig of one tensor-parallel rank, built from the fields it declares
        (imported lazily: the ingress and the router never need torch)."""
        from cbserve.worker.config import ModelConfig

        values = {
            "model": self.model,
            "dtype": self.dtype,
            "device": self.resolved_device,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "cpu_ops": self.cpu_ops,
            "cpu_compact_weights": self.cpu_compact_weights,
            "seed": self.seed,
            "rank": rank,
        }
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in values.items() if k in names and v is not None})


def _none_if_null(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() in {"none", "null", ""}:
        return None
    return value
