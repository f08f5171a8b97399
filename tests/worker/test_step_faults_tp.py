"""Under tensor parallelism a request whose step fails on rank 0 alone (its structured-output matcher: only rank 0
samples) fails alone too: rank 0 tells the other rank through the samples' broadcast, every rank fails the step
(none waits forever in a collective), and the next epoch runs on both. Two spawned processes over gloo, the
fault-injection tiny Llama (tests/tiny_llama.py) cut over 2 ranks."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_llama import TRIGGER, make_fault_model
from worker_testlib import follow_rank0, free_port, leave_group, run_engine

from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.model_runner import ModelRunner
from cbserve.worker.runner.step_guard import StepGuard

BLOCK, NUM_BLOCKS = 4, 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
REQUESTS = [("a", [1, 300, 412, 77], GREEDY), ("b", [1, 5000, 901], GREEDY),
            ("poison", [1, 42, TRIGGER], SamplingParams(temperature=0.0, max_tokens=6,
                                                         structured=StructuredSpec("choice", '["yes", "no"]')))]


class _GuardedBroadcastExecutor:
    """Rank 0's executor: each step goes to rank 1 first, then runs here behind the guard."""

    def __init__(self, runner: ModelRunner) -> None:
        self.guard = StepGuard(runner)

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        dist.broadcast_object_list([so], src=0)
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.guard(so))
        except StepFailedError as e:
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        dist.broadcast_object_list([None], src=0)


def _worker(rank: int, folder: str, port: int, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    finished = False
    try:
        runner = ModelRunner(ModelConfig(model=folder, tensor_parallel_size=2, rank=rank, device="cpu",
                                         block_size=BLOCK), progress=False)  # fmt: skip
        runner.init_kv_cache(NUM_BLOCKS)
        if rank == 0:
            executor = _GuardedBroadcastExecutor(runner)
            run = run_engine(executor, REQUESTS, block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_seqs=4)
            executor.shutdown()
            torch.save((dict(run.finish), {k: v[0] for k, v in run.tokens.items()}), result_file)
        else:
            guard, failures = StepGuard(runner), []

            def step(so: SchedulerOutput) -> None:
                try:
                    guard(so)
                except StepFailedError as e:
                    failures.append(str(e))

            follow_rank0(step)
            torch.save(failures, result_file + ".rank1")
        finished = True
    finally:
        leave_group(finished)


@pytest.mark.timeout(180)
def test_a_failure_on_rank_0_alone_fails_the_step_on_every_rank(tmp_path: Path) -> None:
    folder = make_fault_model(tmp_path / "model", "mask")
    result_file = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(str(folder), free_port(), result_file), nprocs=2, join=True)
    finish, tokens = torch.load(result_file)
    assert finish["poison"] == {0: "error"}
    assert finish["a"] == {0: "length"} and finish["b"] == {0: "length"} and len(tokens["a"]) == 6
    rank1 = torch.load(result_file + ".rank1")
    assert any("rank 0 failed to sample" in f for f in rank1), rank1
