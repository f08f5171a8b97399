"""TP=2 on CPU (two spawned processes, gloo) gives the same greedy tokens (and prompt logprobs: every rank runs
the vocabulary-gathering LM head over the prompt rows) as TP=1 on the tiny model."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from worker_testlib import follow_rank0, free_port, leave_group, make_tiny_model, run_engine

from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput, done_future
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.runner.model_runner import ModelRunner

BLOCK, NUM_BLOCKS = 4, 64
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [11, 12, 13], list(range(40, 75))]


class _BroadcastExecutor:
    """Rank 0's executor: every SchedulerOutput is broadcast to rank 1 before running locally."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        dist.broadcast_object_list([so], src=0)
        return done_future(self.runner.execute_model(so))

    def shutdown(self) -> None:
        dist.broadcast_object_list([None], src=0)


def _requests() -> list:
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_prompt_lps = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    return [(f"r{i}", p, with_prompt_lps if i == 2 else sp) for i, p in enumerate(PROMPTS)]


def _prompt_lps(run: object) -> list[float]:
    return [e.logprob for e in run.prompt_logprobs["r2"][1:]]  # type: ignore[attr-defined]


def _worker(rank: int, folder: str, port: int, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    finished = False
    try:
        cfg = ModelConfig(model=folder, tensor_parallel_size=2, rank=rank, device="cpu")
        runner = ModelRunner(dataclasses.replace(cfg, block_size=BLOCK), progress=False)
        runner.init_kv_cache(NUM_BLOCKS)
        if rank == 0:
            executor = _BroadcastExecutor(runner)
            run = run_engine(executor, _requests(), block_size=BLOCK, num_blocks=NUM_BLOCKS,
                             max_num_batched_tokens=16, max_num_seqs=4)
            executor.shutdown()
            torch.save(({k: v[0] for k, v in run.tokens.items()}, _prompt_lps(run)), result_file)
        else:

            def step(so: SchedulerOutput) -> None:
                assert runner.execute_model(so).req_ids == []  # only rank 0 samples

            follow_rank0(step)
        finished = True
    finally:
        leave_group(finished)


@pytest.mark.timeout(180)
def test_tp2_matches_tp1(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "model", "llama_gqa")
    executor = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=NUM_BLOCKS,
                             progress=False)
    tp1 = run_engine(executor, _requests(), block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
                     max_num_seqs=4)
    result_file = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(str(folder), free_port(), result_file), nprocs=2, join=True)
    tp2, tp2_lps = torch.load(result_file)
    assert tp2 == {k: v[0] for k, v in tp1.tokens.items()}
    tp1_lps = _prompt_lps(tp1)
    assert len(tp2_lps) == len(tp1_lps) == len(PROMPTS[2]) - 1
    assert max(abs(a - b) for a, b in zip(tp1_lps, tp2_lps, strict=True)) < 1e-4


def test_tp_size_must_match_the_process_group(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "model", "llama_gqa")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelRunner(ModelConfig(model=str(folder), tensor_parallel_size=2, device="cpu", block_size=BLOCK),
                    progress=False)
