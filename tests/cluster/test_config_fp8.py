"""The FP8 keys of the one configuration (vLLM's names): ``quantization`` and ``kv_cache_dtype`` from YAML, flags and
``LLM(**fields)``, their values and defaults, and the combinations refused at start-up with the reason."""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic
import pytest

from cbserve.cluster.cli.serve import add_arguments, config_from_args
from cbserve.config import CBServeConfig
from cbserve.config.offline import offline_config
from cbserve.config.servable import kv_block_bytes
from cbserve.worker.config import ModelConfig
from cbserve.worker.loading.model_info import ModelInfo


def test_defaults_are_vllms() -> None:
    config = CBServeConfig(device="cpu")
    assert config.quantization is None and config.kv_cache_dtype == "auto"
    mc = config.worker_model_config()
    assert mc.quantization is None and mc.kv_cache_dtype == "auto" and not mc.kv_fp8


def test_yaml_flags_and_offline_fields_reach_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("device: cpu\nquantization: fp8\nkv_cache_dtype: fp8_e4m3\n")
    from_yaml = CBServeConfig.from_yaml(path).worker_model_config()
    assert (from_yaml.quantization, from_yaml.kv_cache_dtype, from_yaml.kv_fp8) == ("fp8", "fp8_e4m3", True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = config_from_args(parser.parse_args(["--device", "cpu", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert (flags.quantization, flags.kv_cache_dtype) == ("fp8", "fp8")
    offline = offline_config(None, {"quantization": "fp8", "kv_cache_dtype": "fp8", "device": "cpu"})
    assert offline.worker_model_config().kv_fp8 and offline.worker_model_config().quantization == "fp8"


@pytest.mark.parametrize("fields,match", [
    ({"quantization": "int8"}, "quantization"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8", "attention_backend": "cpu"}, "triton and torch attention backends only"),
    ({"kv_cache_dtype": "fp8", "attention_backend": "flash"}, "not by attention_backend='flash'"),
    ({"quantization": "fp8", "device": "cpu", "cpu_ops": "native"}, "emulation on the torch ops"),
    ({"quantization": "fp8", "device": "cpu", "cpu_ops": "onednn"}, "use cpu_ops 'auto' or 'torch'"),
    ({"model": "sim", "quantization": "fp8"}, "quantization would have no effect"),
    ({"model": "sim", "kv_cache_dtype": "fp8"}, "kv_cache_dtype would have no effect"),
])  # fmt: skip
def test_refused_combinations_name_the_reason(fields: dict, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        CBServeConfig(**fields)
    if "model" not in fields:  # the worker's own config says the same
        with pytest.raises(ValueError, match=match.split(" would")[0]):
            ModelConfig(**fields)


def test_allowed_combinations() -> None:
    CBServeConfig(quantization="fp8", device="cpu", cpu_ops="torch", attention_backend="torch")
    CBServeConfig(kv_cache_dtype="fp8", attention_backend="triton", device="cuda")
    CBServeConfig(quantization="fp8", cpu_ops="native", device="cuda")  # cpu_ops is the CPU's; CUDA ignores it


def test_the_cpu_kv_budget_counts_fp8_blocks() -> None:
    """The start-up check sizes an FP8 cache as the worker allocates it: e4m3 bytes and a float32 scale per token
    and head (SmolLM2: 3 KV heads of 64, 30 layers)."""
    info = ModelInfo("llama", 9, 3, 64, 30, 8192)
    fp8 = kv_block_bytes(CBServeConfig(device="cpu", kv_cache_dtype="fp8", dtype="bfloat16"), info)
    bf16 = kv_block_bytes(CBServeConfig(device="cpu", dtype="bfloat16"), info)
    assert fp8 == 2 * 30 * 16 * 3 * (64 + 4) and bf16 == 2 * 30 * 16 * 3 * 64 * 2
