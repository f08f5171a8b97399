"""The keys of a configuration with ``model: sim`` (the simulated engine, ``worker/runner/sim_runner.py``): the ones
that make no sense without weights are refused, naming the key, instead of being silently ignored."""

from __future__ import annotations

from typing import Any

from cbserve.worker.sim_cost import SIM_MODEL, SimCostModel

# keys that only choose how real weights are computed on a CPU or GPU: the sim computes nothing
_NO_EFFECT = ("dtype", "cpu_ops", "cpu_isa", "cpu_compact_weights", "cpu_decode_activations", "cpu_prefill_activations",
              "attention_backend", "enforce_eager", "cudagraph_mode", "kv_cache_memory_bytes", "worker_torch_threads",
              "quantization", "kv_cache_dtype")


def is_sim(model: str | None) -> bool:
    return model == SIM_MODEL


def check_sim_keys(config: Any) -> None:
    """``config``: a ``CBServeConfig``. Raises ValueError for a key the simulated engine cannot honour: one set
    to anything but its default."""
    if not is_sim(config.model):
        return
    fields = type(config).model_fields  # a value other than the default (a config is re-validated from its dump)
    refused = [key for key in _NO_EFFECT if getattr(config, key) != fields[key].default]
    if refused:
        raise ValueError(f"model 'sim' (the simulated engine) computes nothing: {', '.join(refused)} would have no "
                         "effect; leave them unset")
    checks = {
        "tensor_parallel_size > 1": config.tensor_parallel_size != 1,
        "runner 'pooling'": config.runner == "pooling",
        "speculative_config": config.speculative_config is not None,
        "enable_lora": config.enable_lora,
        "device 'cuda'": config.device == "cuda",
        "the KV tiers (kv_offloading_size)": config.kv_offloading_size is not None,
    }
    bad = [what for what, hit in checks.items() if hit]
    if bad:
        raise ValueError(f"model 'sim' (one simulated H100, Llama-3-8B) does not combine with {', '.join(bad)}")


def sim_num_blocks(config: Any) -> int:
    """KV blocks of the simulated H100 at the config's ``gpu_memory_utilization`` (what its workers report)."""
    return SimCostModel().num_blocks(config.block_size, config.gpu_memory_utilization)
