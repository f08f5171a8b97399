"""RotaryEmbedding builds its cos/sin tables on the default device the model is built under (model_build.py
builds under ``with torch.device(device)``), for the rope types transformers computes (yarn, longrope) too.
The meta device stands in for CUDA: a table made on the CPU and one made on the default device do not mix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from family_testlib import COMMON, FAMILIES

from cbserve.worker.layers.rotary import RotaryEmbedding

HEAD_DIM = 16
MAX_POSITIONS = 256


def _family_config(family: str) -> Any:
    cfg_name, _, extra = FAMILIES[family]
    return getattr(transformers, cfg_name)(**{**COMMON, **extra})


def _configs() -> dict[str, Any]:
    yarn = transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    return {"default": transformers.LlamaConfig(**COMMON), "yarn": yarn,
            "longrope_short": _family_config("phi3_short"), "longrope_long": _family_config("phi3_long")}


@pytest.mark.parametrize("name", ["default", "yarn", "longrope_short", "longrope_long"])
def test_tables_are_made_on_the_default_device(name: str) -> None:
    cfg = _configs()[name]
    on_cpu = RotaryEmbedding(cfg, HEAD_DIM, MAX_POSITIONS)
    with torch.device("meta"):
        on_meta = RotaryEmbedding(cfg, HEAD_DIM, MAX_POSITIONS)
    assert on_meta.cos.device.type == on_meta.sin.device.type == "meta"
    assert on_meta.cos.shape == on_cpu.cos.shape == (MAX_POSITIONS, HEAD_DIM)
    assert on_cpu.cos.device.type == "cpu"
    assert on_meta.cos.dtype == on_cpu.cos.dtype == torch.float32

