"""A replica of tensor-parallel size 1 runs its rank in the engine actor's process (cluster/engine/rank.py): the
engine's own served loop (``EngineCore.step_async`` on an event loop, two steps in flight with async scheduling)
over ``RayExecutor`` with the in-actor rank, on a tiny random Llama. Its greedy tokens equal the offline ``LLM``'s,
token for token, with n > 1 and prompts that share prefixes in the mix (the step and its reply are shared objects
now, not pickled copies: a scheduler that changed a step's lists after sending it would show here), nothing is
pickled on the way, and every KV block is free after."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest
from tiny_llama import make_tiny_llama

from cbserve import LLM, SamplingParams
from cbserve.cluster.engine.ray_executor import RayExecutor
from cbserve.config import CBServeConfig
from cbserve.scheduler.engine_core import EngineCore
from cbserve.scheduler.requests.request import EngineRequest

PROMPTS = [[1, 300 + 7 * i, 412, 5000 + 13 * i, 77, 901 + i, 17, 33, 95][: 3 + i % 7] for i in range(9)]
PROMPTS += [PROMPTS[8] + [5, 6, 7, 8, 9, 10, 11, 12], PROMPTS[8] + [5, 6, 7, 8, 9, 10, 11, 13]]  # cached prefixes
ARGS: dict[str, Any] = dict(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=16, block_size=4,
                            kv_cache_memory_bytes=4 * 1024**2, max_num_batched_tokens=32)  # fmt: skip


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6 + i % 5, ignore_eos=True, n=2 if i == 3 else 1)


async def _serve(config: CBServeConfig) -> tuple[dict[tuple[str, int], list[int]], int, int]:
    executor = await RayExecutor.create(config, "0", "unused")
    assert executor.local is not None and executor.workers == [] and executor.pg is None
    engine = EngineCore(config.engine_config(executor.num_blocks), executor)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(str(i), prompt, _params(i)))
    tokens: dict[tuple[str, int], list[int]] = {}

    async def wait(future: Any) -> None:
        await (asyncio.sleep(0.001) if future is None else asyncio.wait([asyncio.wrap_future(future)]))

    while engine.has_work():
        result = await engine.step_async(wait)
        for out in [] if result is None else result.outputs:
            tokens.setdefault((out.req_id, out.index), []).extend(out.new_token_ids)
    kv = engine.scheduler.kv
    free, total = kv.num_free_blocks, kv.num_blocks
    executor.shutdown()
    return tokens, free, total


def test_the_in_actor_rank_serves_the_offline_tokens_and_pickles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_tiny_llama(tmp_path / "tiny")
    llm = LLM(str(folder), progress=False, **ARGS)
    reference = {(str(i), c.index): c.token_ids
                 for i, o in enumerate(llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], use_tqdm=False))
                 for c in o.outputs}  # fmt: skip
    config = CBServeConfig(model=str(folder), worker_torch_threads=1, **ARGS)
    assert config.async_scheduling  # the served engine keeps two steps in flight
    pickled: list[type] = []
    real_dumps = pickle.dumps
    monkeypatch.setattr(pickle, "dumps", lambda obj, *a, **k: pickled.append(type(obj)) or real_dumps(obj, *a, **k))
    tokens, free, total = asyncio.run(_serve(config))
    assert tokens == reference and len(tokens) == len(PROMPTS) + 1
    assert free == total
    assert pickled == []
