"""Can this configuration serve this model? The checks of a ``CBServeConfig`` that need the model's shape (read
without torch: its heads against the tensor-parallel size, its context length, the KV cache against one request
of max_model_len tokens): a configuration that could never serve stops at start-up, served or offline, with one
``ConfigError`` message."""

from __future__ import annotations

import math

from cbserve.config.lora_config import check_allowed_dirs, check_lora_modules
from cbserve.config.serve_config import DEFAULT_MODEL_NAME, CBServeConfig, ConfigError, connected_ray
from cbserve.config.sim_config import is_sim, sim_num_blocks
from cbserve.worker.config import DTYPE_BYTES, KV_FP8_DTYPES, kv_head_bytes
from cbserve.worker.loading.model_info import SUPPORTED_MODEL_TYPES, ModelInfo, locate_model, read_model_info
from cbserve.worker.loading.pooling_config import read_pooling_config


def known_device(config: CBServeConfig) -> str | None:
    """The device, where it is known without importing torch: set in the config, or decided by the Ray
    cluster this process is connected to; None otherwise."""
    if config.device != "auto":
        return config.device
    return config.resolved_device if connected_ray() is not None else None


def servable_config(config: CBServeConfig, device: str | None = None) -> CBServeConfig:
    """``config`` checked against its model (read without torch) and resolved (an unset max_model_len
    capped by the model's). ``device``: "cpu" or "cuda" where known (the KV budget is checked on CPU);
    None = unknown yet. Raises ConfigError."""
    try:
        info = read_model_info(config.model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the model {config.model or DEFAULT_MODEL_NAME!r}: {e}") from e
    if config.runner == "pooling":  # a sentence-transformers pipeline cbserve cannot run stops here
        try:
            read_pooling_config(locate_model(config.model).path)
        except ValueError as e:
            raise ConfigError(f"runner 'pooling': {e}") from e
    return check_servable(config, info, device)


def check_servable(config: CBServeConfig, info: ModelInfo, device: str | None = None) -> CBServeConfig:
    """The model-dependent checks (see ``servable_config``), given the model's shape."""
    if info.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {info.model_type!r} is not supported ({', '.join(SUPPORTED_MODEL_TYPES)})")
    tp = config.tensor_parallel_size
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"):
        if (n := getattr(info, what)) is not None and n % tp:
            raise ConfigError(f"{what} ({n}) is not divisible by the tensor-parallel size ({tp})")
    model_max = info.max_position_embeddings
    if model_max is not None and config.max_model_len > model_max:
        if "max_model_len" in config.model_fields_set:
            raise ConfigError(
                f"max_model_len ({config.max_model_len}) is longer than the model's max_position_embeddings "
                f"({model_max})"
            )
        config = config.model_copy(update={"max_model_len": model_max})
    try:
        check_lora_modules(config.lora_modules, info, config.max_lora_rank)
        check_allowed_dirs(config.lora_allowed_dirs)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    num_blocks = config.num_kv_blocks
    if num_blocks is None and is_sim(config.model):  # the simulated H100's (worker/sim_cost.py)
        num_blocks, device = sim_num_blocks(config), "cuda"  # its budget is gpu_memory_utilization
    elif num_blocks is None and device == "cpu":  # on CUDA the budget is known once the weights are loaded
        num_blocks = config.kv_cache_memory_bytes // kv_block_bytes(config, info)
    if num_blocks is not None:
        check_kv_capacity(config, num_blocks, device)
    return config


def kv_block_bytes(config: CBServeConfig, info: ModelInfo) -> int:
    """Bytes of one KV block on one rank (all layers, K and V), as the worker allocates it on CPU (an FP8 cache:
    e4m3 values and a float32 scale per token and head)."""
    elem = DTYPE_BYTES.get(config.dtype, 4)  # "auto" is float32 on CPU
    kv_heads = info.num_key_value_heads // config.tensor_parallel_size
    head = kv_head_bytes(info.head_dim, elem, config.kv_cache_dtype in KV_FP8_DTYPES)
    return 2 * info.num_hidden_layers * config.block_size * kv_heads * head


def check_kv_capacity(config: CBServeConfig, num_blocks: int, device: str | None = None) -> None:
    """One request of max_model_len tokens must fit in the KV cache (as the engine admits it: the last
    token's KV is never stored). Raises ConfigError."""
    needed = max(1, math.ceil((config.max_model_len - 1) / config.block_size))
    if num_blocks >= needed:
        return
    if config.num_kv_blocks is not None:
        budget = f"num_kv_blocks={config.num_kv_blocks}"
    elif device == "cuda":
        budget = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        budget = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    raise ConfigError(
        f"the KV cache ({budget}) holds {num_blocks} blocks of {config.block_size} tokens, but one request of "
        f"max_model_len ({config.max_model_len}) tokens needs {needed}: raise the KV budget or lower max_model_len"
    )
