"""benchmarks/gpu_workload.py on the CPU: ``build_cbserve`` loads the seeded random weights of ``random_weights``
into cbserve's model (the model folder holds only a config)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture
def gw(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/gpu_workload.py, imported from its folder."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("gpu_workload")


def test_build_cbserve_loads_the_seeded_random_weights(gw: ModuleType, tmp_path: Path) -> None:
    cfg = gw.write_model_folder("tiny", tmp_path)
    args = argparse.Namespace(
        prompt_len=8,
        max_out=8,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.5,
        attention_backend="auto",
        enforce_eager=True,
        seed=3,
    )
    device = torch.device("cpu")
    executor = gw.build_cbserve(args, tmp_path, cfg, device)
    try:
        model = executor.runner.model
        expected = dict(gw.random_weights(cfg, device, torch.float32, args.seed))
        embed = model.model.embed_tokens.weight
        assert embed.shape == (cfg.vocab_size, cfg.hidden_size)
        torch.testing.assert_close(embed, expected["model.embed_tokens.weight"], rtol=0, atol=0)
        other_seed = next(iter(gw.random_weights(cfg, device, torch.float32, args.seed + 1)))[1]
        assert not torch.equal(embed, other_seed)  # the seed decides the weights
        assert executor.num_blocks > 0
    finally:
        executor.shutdown()
