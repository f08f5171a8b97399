"""ModelConfig: importable without torch (the cluster's config derives it), and its ``seed`` seeds the
sampling of requests that bring no seed of their own (the other fields are proven where they act:
test_model_runner, test_cpu_*, test_compact_weights, test_tensor_parallel, test_cuda_graphs_runner)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from worker_testlib import make_tiny_model, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor

BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama_gqa")


def _unseeded_samples(folder: Path, seed: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)  # no per-request seed
    requests = [(f"r{i}", [3 + i, 4, 5, 6], params) for i in range(4)]
    ex = LocalExecutor(ModelConfig(model=str(folder), seed=seed, device="cpu", block_size=BLOCK), num_blocks=64,
                       progress=False)
    run = run_engine(ex, requests, block_size=BLOCK, num_blocks=64)
    return {rid: run.tokens[rid][0] for rid, _, _ in requests}


def test_seed_makes_unseeded_sampling_reproducible(folder: Path) -> None:
    first = _unseeded_samples(folder, seed=3)
    assert _unseeded_samples(folder, seed=3) == first
    assert _unseeded_samples(folder, seed=4) != first  # 24 tokens drawn from 320 at temperature 1


def test_model_config_imports_without_torch() -> None:
    code = "import sys; from cbserve.worker.config import ModelConfig; ModelConfig(dtype='bfloat16'); "
    code += "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
