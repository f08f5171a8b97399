"""ModelRunner protocol handling on the tiny model: n > 1 sampling, copy-on-write block copies, state
dropping, seeded sampling independent of batch companions, config validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from worker_testlib import make_tiny_model, run_engine

from cbserve.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.attention import get_attention_backend
from cbserve.worker.attention.cpu_backend import CpuAttentionBackend
from cbserve.worker.attention.torch_backend import TorchAttentionBackend
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu.native import load_cpu_kernels
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.runner.kv_cache import copy_blocks
from cbserve.worker.runner.model_runner import ModelRunner

BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama_gqa")


@pytest.fixture
def runner(folder: Path) -> ModelRunner:
    r = ModelRunner(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), progress=False)
    r.init_kv_cache(64)
    return r


def _new(rid: str, ids: list[int], sp: SamplingParams, blocks: list[int], **kw: object) -> NewRequestData:
    return NewRequestData(rid, ids, len(ids), sp, blocks, 0, **kw)  # type: ignore[arg-type]


def _so(new: list[NewRequestData], cached: list[CachedRequestData], sched: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(new, cached, sched, sum(sched.values()))


def test_num_samples_forks_with_seed_plus_i(runner: ModelRunner) -> None:
    sp = SamplingParams(temperature=1.5, n=4, seed=11)
    prompt = [3, 4, 5, 6, 7]
    out = runner.execute_model(_so([_new("p", prompt, sp, [0, 1], num_samples=4, seed=11)], [], {"p": 5}))
    assert out.req_ids == ["p"] and len(out.sampled_token_ids[0]) == 4
    for i in range(4):  # each sample equals a single-sample run seeded with seed + i
        one = runner.execute_model(_so([_new(f"s{i}", prompt, sp, [2 + 2 * i, 3 + 2 * i], seed=11 + i)], [],
                                        {f"s{i}": 5}))
        assert one.sampled_token_ids[0] == [out.sampled_token_ids[0][i]]


def test_block_copies_happen_before_the_forward(runner: ModelRunner) -> None:
    for k, v in runner.kv_caches:
        k[3].fill_(1.5)
        v[3].fill_(-2.0)
    so = SchedulerOutput(block_copies=[(3, 7)])
    runner.execute_model(so)
    for k, v in runner.kv_caches:
        assert torch.equal(k[7], k[3]) and torch.equal(v[7], v[3])
    copy_blocks(runner.kv_caches, [])  # no-op


def test_finished_and_preempted_requests_are_dropped(runner: ModelRunner) -> None:
    sp = SamplingParams(temperature=0.0)
    runner.execute_model(_so([_new("a", [1, 2, 3], sp, [0]), _new("b", [4, 5], sp, [1])], [], {"a": 3, "b": 2}))
    assert set(runner.requests) == {"a", "b"}
    runner.execute_model(SchedulerOutput(finished_req_ids={"a"}, preempted_req_ids={"b"}))
    assert runner.requests == {}
    with pytest.raises(KeyError):
        runner.execute_model(_so([], [CachedRequestData("a", [9], [], 3)], {"a": 1}))


def test_partial_prefill_is_not_sampled(runner: ModelRunner) -> None:
    sp = SamplingParams(temperature=0.0)
    out = runner.execute_model(_so([_new("a", list(range(10, 20)), sp, [0, 1, 2])], [], {"a": 6}))
    assert out.req_ids == []
    out = runner.execute_model(_so([], [CachedRequestData("a", [], [], 6)], {"a": 4}))
    assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1


def test_seeded_outputs_do_not_depend_on_batch_companions(folder: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    target = ("t", [7, 8, 9, 10, 11, 12], seeded)
    alone_ex = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=64,
                             progress=False)
    alone = run_engine(alone_ex, [target], block_size=BLOCK, num_blocks=64)
    others = [(f"o{i}", [20 + i] * (3 + 5 * i), SamplingParams(temperature=0.8, max_tokens=8 + i, ignore_eos=True))
              for i in range(4)]
    crowd_ex = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=24,
                             progress=False)
    crowd = run_engine(crowd_ex, [*others[:2], target, *others[2:]], block_size=BLOCK, num_blocks=24,
                       max_num_batched_tokens=8, join_at_step={"o3": 4})
    assert crowd.tokens["t"][0] == alone.tokens["t"][0]


def test_n_greater_than_one_through_the_engine(folder: Path) -> None:
    sp = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6, ignore_eos=True)
    ex = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=BLOCK), num_blocks=64, progress=False)
    run = run_engine(ex, [("r", [1, 2, 3, 4, 5, 6], sp)], block_size=BLOCK, num_blocks=64)
    assert sorted(run.tokens["r"]) == [0, 1, 2]
    assert all(len(t) == 6 for t in run.tokens["r"].values())


def test_attention_backend_selection() -> None:
    cpu_kernels_built = load_cpu_kernels().kernels is not None
    assert get_attention_backend("auto", "cpu") is (CpuAttentionBackend if cpu_kernels_built else TorchAttentionBackend)
    assert get_attention_backend("torch", "cpu") is TorchAttentionBackend
    assert get_attention_backend("auto", "cpu", native_cpu=False) is TorchAttentionBackend  # cpu_ops="torch"
    with pytest.raises(ValueError):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError):
        get_attention_backend("nonsense", "cpu")


@pytest.mark.parametrize(
    "bad", [{"dtype": "int8"}, {"device": "tpu"}, {"max_model_len": 0}, {"tensor_parallel_size": 0},
            {"rank": 1}, {"gpu_memory_utilization": 1.5}, {"attention_backend": "x"}, {"kv_cache_memory_bytes": 0},
            {"cpu_ops": "mkl"}],
)
def test_model_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        ModelConfig(**bad)


def test_kv_cache_sized_from_budget(folder: Path) -> None:
    r = ModelRunner(ModelConfig(model=str(folder), kv_cache_memory_bytes=1 << 20, device="cpu", block_size=BLOCK),
                    progress=False)
    assert r.determine_num_blocks() == (1 << 20) // r.block_bytes()
    r2 = ModelRunner(ModelConfig(model=str(folder), kv_cache_memory_bytes=10, device="cpu", block_size=BLOCK),
                     progress=False)
    with pytest.raises(ValueError):
        r2.determine_num_blocks()
