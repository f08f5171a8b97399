"""TP=2 on CPU (two spawned processes, gloo) gives TP=1's greedy tokens for the layers the newer families add:
per-head q/k norms (Qwen3, Gemma 3), Gemma's norms, GeGLU and soft-capping (Gemma 2), a second rotary table
for local layers (Gemma 3) and checkpoint-fused q/k/v and gate/up weights cut per rank (Phi-3); every one of
them with sliding-window layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from family_testlib import make_family_model
from test_tensor_parallel import BLOCK, NUM_BLOCKS, _requests, _worker
from worker_testlib import free_port, run_engine

from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "phi3_short"])
def test_tp2_matches_tp1(tmp_path: Path, family: str) -> None:
    folder = make_family_model(tmp_path / "model", family)
    executor = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=NUM_BLOCKS,
                             progress=False)
    tp1 = run_engine(executor, _requests(), block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
                     max_num_seqs=4)
    result_file = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(str(folder), free_port(), result_file), nprocs=2, join=True)
    tp2, _ = torch.load(result_file)  # (tokens, prompt logprobs): test_tensor_parallel's worker
    assert tp2 == {k: v[0] for k, v in tp1.tokens.items()}
    assert all(len(v[0]) == 12 for v in tp1.tokens.values())
