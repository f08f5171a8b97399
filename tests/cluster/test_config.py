"""CBServeConfig from YAML, from Serve args and from `cbserve serve` flags (no Ray cluster needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pydantic
import pytest
from cbserve.cluster.config import CBServeConfig
from cbserve.cluster.serve_cli import add_arguments, config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_local_yaml_serves_the_bundled_model_on_cpu() -> None:
    config = CBServeConfig.from_yaml(ROOT / "deploy" / "serve-local.yaml")
    assert config.model is None and config.model_name == "SmolLM2-135M-Instruct"
    assert config.resolved_device == "cpu"  # no GPU here, Ray not initialised: torch decides
    assert config.port == 8000 and config.tensor_parallel_size == 1


def test_serve_config_yaml_takes_the_first_apps_args() -> None:
    config = CBServeConfig.from_yaml(ROOT / "deploy" / "serve.yaml")
    assert config.tensor_parallel_size == 2 and config.num_replicas == 2 and config.device == "cuda"


def test_flags_override_the_file() -> None:
    config = config_from_args(_parse(["--config", str(ROOT / "deploy" / "serve-local.yaml"), "--port", "9123",
                                      "--num-replicas", "3"]))
    assert config.port == 9123 and config.num_replicas == 3 and config.max_num_seqs == 64


def test_no_arguments_give_the_defaults() -> None:
    config = config_from_args(_parse([]))
    assert config.model is None and config.port == 8000 and config.num_replicas >= 1


def test_serve_run_string_args_are_coerced() -> None:
    config = CBServeConfig.from_args({"num-replicas": "2", "api_key": "null", "max_model_len": "512"})
    assert config.num_replicas == 2 and config.api_key is None and config.max_model_len == 512


@pytest.mark.parametrize(
    "bad", [{"no_such_field": 1}, {"tensor_parallel_size": 0}, {"route_prefix": "v1"}, {"block_size": -16},
            {"cpu_ops": "mkl"}]
)
def test_bad_values_are_rejected(bad: dict) -> None:
    with pytest.raises((pydantic.ValidationError, ValueError)):
        CBServeConfig.from_args(bad)


def test_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        CBServeConfig.from_yaml(path)


def test_cpu_ops_reaches_the_worker_config() -> None:
    assert CBServeConfig.from_args({}).worker_model_config().cpu_ops == "auto"
    assert CBServeConfig.from_args({"cpu_ops": "onednn"}).worker_model_config().cpu_ops == "onednn"
    assert CBServeConfig.from_args({}).worker_model_config().cpu_compact_weights is True
    assert CBServeConfig.from_args({"cpu_compact_weights": False}).worker_model_config().cpu_compact_weights is False
