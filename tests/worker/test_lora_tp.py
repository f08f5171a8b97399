"""LoRA under tensor parallelism: TP=2 on CPU (two spawned processes, gloo) gives HF + PEFT's greedy tokens on a
mixed batch of two adapters and the base model; column-parallel layers split B's rows as the base weight, row-
parallel layers split A's columns and add their partial products before the all-reduce. Llama (q/k/v and gate/up
adapted apart, into fused layers) and Phi-3 (adapters on its checkpoint-fused qkv_proj / gate_up_proj)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from family_testlib import make_family_model, save_tokenizer
from lora_testlib import ALL_SPLIT, make_adapter, peft_greedy, peft_model
from test_tensor_parallel import BLOCK, NUM_BLOCKS, PROMPTS, _BroadcastExecutor
from worker_testlib import follow_rank0, free_port, leave_group, make_tiny_model

from cbserve.scheduler import CacheConfig, EngineConfig, EngineCore, EngineRequest, LoRARequest, SchedulerConfig
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.model_runner import ModelRunner

MAX_NEW = 8
TARGETS = {"llama": ALL_SPLIT, "phi3_short": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def _rank0(runner: ModelRunner, loras: list[LoRARequest | None]) -> dict[str, list[int]]:
    executor = _BroadcastExecutor(runner)
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128, max_loras=2),
        cache=CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS),
    )
    engine = EngineCore(config, executor)  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        engine.add_request(EngineRequest(f"r{i}", list(prompt), sp, eos_token_id=2, lora=lora))
    tokens: dict[str, list[int]] = defaultdict(list)
    while engine.has_work():
        result = engine.step_with_batch_queue()
        for o in [] if result is None else result.outputs:
            tokens[o.req_id].extend(o.new_token_ids)
    executor.shutdown()
    return dict(tokens)


def _worker(rank: int, folder: str, port: int, loras: list[LoRARequest | None], result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    finished = False
    try:
        cfg = ModelConfig(model=folder, tensor_parallel_size=2, rank=rank, enable_lora=True, max_loras=2,
                          max_lora_rank=8, max_model_len=128, device="cpu")
        runner = ModelRunner(dataclasses.replace(cfg, block_size=BLOCK), progress=False)
        runner.init_kv_cache(NUM_BLOCKS)
        if rank == 0:
            torch.save(_rank0(runner, loras), result_file)
        else:
            follow_rank0(runner.execute_model)
        finished = True
    finally:
        leave_group(finished)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(TARGETS))
def test_tp2_lora_matches_peft(tmp_path: Path, family: str) -> None:
    base = tmp_path / "base"
    if family == "llama":
        make_tiny_model(base, "llama_gqa")
        save_tokenizer(base)
    else:
        make_family_model(base, family)
    one = LoRARequest("one", 1, str(make_adapter(base, tmp_path / "one", 1, r=8, targets=TARGETS[family])))
    two = LoRARequest("two", 2, str(make_adapter(base, tmp_path / "two", 2, r=4, targets=TARGETS[family][:2])))
    loras = [one, None, two]
    result_file = str(tmp_path / "tp2.pt")
    mp.spawn(_worker, args=(str(base), free_port(), loras, result_file), nprocs=2, join=True)
    got = torch.load(result_file)
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        ref = peft_greedy(peft_model(base, None if lora is None else Path(lora.lora_path)), prompt, MAX_NEW)
        assert got[f"r{i}"] == ref, (family, i)
