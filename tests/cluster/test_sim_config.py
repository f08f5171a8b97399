"""``model: sim`` in the configuration: keys without effect are refused, the KV check uses the simulated H100."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cbserve.config import CBServeConfig, ConfigError, servable_config
from cbserve.worker.sim_cost import SimCostModel


def test_sim_config_is_servable_with_the_simulated_kv_cache() -> None:
    config = servable_config(CBServeConfig(model="sim", num_replicas=2, max_model_len=8192, device="cpu"), "cpu")
    assert config.model_name == "sim" and config.max_model_len == 8192
    cfg = config.engine_config(SimCostModel().num_blocks(16, 0.9))
    assert cfg.cache.num_blocks > 20_000
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):  # 16 GB of weights leave no KV at 0.2
        servable_config(CBServeConfig(model="sim", gpu_memory_utilization=0.2, device="cpu"), "cpu")


@pytest.mark.parametrize("key, value, match", [
    ("dtype", "bfloat16", "dtype would have no effect"),
    ("cpu_ops", "torch", "cpu_ops"),
    ("kv_cache_memory_bytes", 1 << 20, "kv_cache_memory_bytes"),
    ("tensor_parallel_size", 2, "tensor_parallel_size"),
    ("enable_lora", True, "enable_lora"),
    ("runner", "pooling", "pooling"),
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}, "speculative_config"),
    ("kv_offloading_size", 1.0, "kv_offloading_size"),  # the sim holds no KV to keep
])  # fmt: skip
def test_sim_refuses_keys_it_cannot_honour(key: str, value: object, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        CBServeConfig(model="sim", **{key: value})
