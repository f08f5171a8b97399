"""Greedy outputs of the worker equal HF transformers' generate() token for token, through a real
EngineCore with chunked prefill, prefix-cache hits, preemption and requests joining mid-batch; logprobs
equal HF's log_softmax of the logits."""

from __future__ import annotations

import random

import pytest
import torch
from worker_testlib import VARIANTS, hf_greedy, make_tiny_model, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor

MAX_NEW = 20


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(21)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(k)] for k in (1, 6, 13)]
    prompts += [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 37, 70)]
    return prompts


def test_greedy_matches_hf_with_chunking_prefix_cache_preemption_and_joins(tiny: tuple) -> None:
    folder, hf = tiny
    prompts = _prompts(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    executor = LocalExecutor(ModelConfig(model=str(folder), device="cpu", block_size=4), num_blocks=40, progress=False)
    run = run_engine(executor, reqs, block_size=4, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=4,
                     join_at_step={"r2": 5, "r5": 9, "r6": 12})
    assert run.num_preemptions > 0 and run.prefix_hits > 0
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, MAX_NEW), rid
        assert run.finish[rid][0] == "length"
        # logprobs of the same tokens vs HF's log_softmax (fp32, within 1e-4), rank 1 under greedy.
        seq = prompt + run.tokens[rid][0]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
        for j, lp in enumerate(run.logprobs[rid][0]):
            pos = len(prompt) - 1 + j
            assert lp.token_id == seq[pos + 1]
            assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4
            assert lp.rank == 1
            top_ids = ref[pos].topk(3).indices.tolist()
            assert [t for t, _ in lp.top] == top_ids
