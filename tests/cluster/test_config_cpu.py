"""The CPU kernels' keys of CBServeConfig (``cpu_ops``, ``cpu_compact_weights``, ``cpu_decode_activations``,
``cpu_prefill_activations``): they reach the worker's ModelConfig, and the int16 activations are refused where no
kernel blocks take them (the kernels' own refusals: tests/worker/test_int16_rows.py, test_cpu_probe_and_isa.py)."""

from __future__ import annotations

import pytest

from cbserve.config import CBServeConfig


def test_cpu_ops_reaches_the_worker_config() -> None:
    assert CBServeConfig.from_args({}).worker_model_config().cpu_ops == "auto"
    assert CBServeConfig.from_args({"cpu_ops": "onednn"}).worker_model_config().cpu_ops == "onednn"
    assert CBServeConfig.from_args({}).worker_model_config().cpu_compact_weights is True
    assert CBServeConfig.from_args({"cpu_compact_weights": False}).worker_model_config().cpu_compact_weights is False
    default = CBServeConfig.from_args({}).worker_model_config()
    assert (default.cpu_decode_activations, default.cpu_prefill_activations) == ("auto", "auto")
    int16 = CBServeConfig.from_args({"cpu_decode_activations": "int16", "device": "cpu"}).worker_model_config()
    assert int16.cpu_decode_activations == "int16" and int16.cpu_prefill_activations == "auto"
    both = {"cpu_decode_activations": "int16", "cpu_prefill_activations": "int16", "device": "cpu"}
    assert CBServeConfig.from_args(both).worker_model_config().cpu_prefill_activations == "int16"
    exact = {"cpu_decode_activations": "float32", "cpu_prefill_activations": "float32", "device": "cpu"}
    assert CBServeConfig.from_args(exact).worker_model_config().cpu_decode_activations == "float32"
    contradiction = {"cpu_decode_activations": "float32", "cpu_prefill_activations": "int16", "device": "cpu"}
    with pytest.raises(ValueError, match="cpu_prefill_activations 'int16' .* 'float32' contradicts it"):
        CBServeConfig.from_args(contradiction).worker_model_config()
    with pytest.raises(ValueError, match="cpu_prefill_activations\n  Input should be 'auto', 'float32' or 'int16'"):
        CBServeConfig.from_args({"cpu_prefill_activations": "int8", "device": "cpu"})


@pytest.mark.parametrize(("conflict", "named"), [({"cpu_ops": "torch"}, "cpu_ops 'torch'"),
                                                 ({"cpu_compact_weights": False}, "cpu_compact_weights=False"),
                                                 ({"device": "cuda"}, "device 'cuda'"),
                                                 ({"quantization": "fp8"}, "quantization 'fp8'")])
def test_int16_decode_activations_are_refused_where_no_cpu_kernel_blocks_take_them(conflict: dict, named: str) -> None:
    from cbserve.worker.config import ModelConfig

    for key in ("cpu_decode_activations", "cpu_prefill_activations"):
        with pytest.raises(ValueError, match=f"{key} 'int16' .*{named}"):
            ModelConfig(**{"device": "cpu", key: "int16", **conflict})
        assert ModelConfig(**{"device": "cpu", **conflict}).cpu_decode_activations == "auto"  # float32 there
    with pytest.raises(ValueError, match="cpu_decode_activations must be one of"):
        ModelConfig(device="cpu", cpu_decode_activations="int8")  # type: ignore[arg-type]
