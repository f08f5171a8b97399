"""Prompt logprobs equal HF transformers' log_softmax at every prompt position (first token None), across
chunked prefill, with a cached shared prefix (a request asking for them computes its prompt anyway), n > 1
and preemption; logit_bias, allowed_token_ids and bad words steer the real model's sampling."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from worker_testlib import hf_greedy, make_tiny_model, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.sampling.token_constraints import banned_by_bad_words

BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path_factory.mktemp("llama_gqa"), "llama_gqa")
    return folder, AutoModelForCausalLM.from_pretrained(folder).eval()


def _ref_logprobs(hf: object, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)  # type: ignore[operator]


def test_prompt_logprobs_match_hf_with_chunks_cache_and_preemption(tiny: tuple) -> None:
    folder, hf = tiny
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(24)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(k)] for k in (0, 9, 30)] + [[7], [9, 11]]
    want = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    reqs = [("warm", shared + [5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    reqs += [(f"p{i}", p, want) for i, p in enumerate(prompts)]
    reqs.append(("n2", prompts[1], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=4, prompt_logprobs=0)))
    reqs.append(("warm2", shared + [6], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
    cfg = ModelConfig(model=str(folder), device="cpu")
    executor = LocalExecutor(dataclasses.replace(cfg, block_size=BLOCK), num_blocks=20, progress=False)
    joins = {"p0": 3, "p1": 3, "p2": 4, "warm2": 3}
    run = run_engine(executor, reqs, block_size=BLOCK, num_blocks=20, max_num_batched_tokens=16, max_num_seqs=4,
                     join_at_step=joins)
    assert run.num_preemptions > 0, "the cache is small enough to preempt"
    assert run.prefix_hits > 0, "the shared prefix is cached (used by warm2 only)"
    assert "warm" not in run.prompt_logprobs and "warm2" not in run.prompt_logprobs
    for rid, prompt, sp in reqs[1:-1]:
        got = run.prompt_logprobs[rid]
        assert len(got) == len(prompt) and got[0] is None, rid
        ref = _ref_logprobs(hf, prompt)
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert entry.token_id == prompt[pos]
            assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4, (rid, pos)
            assert entry.rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
            assert [t for t, _ in entry.top] == ref[pos - 1].topk(sp.prompt_logprobs or 1).indices.tolist()[
                : sp.prompt_logprobs]
        if rid.startswith("p"):  # outputs unchanged by asking for prompt logprobs
            assert run.tokens[rid][0] == hf_greedy(hf, prompt, 6), rid
    assert sorted(run.tokens["n2"]) == [0, 1]


def test_logit_bias_allowed_tokens_and_bad_words_steer_sampling(tiny: tuple) -> None:
    folder, hf = tiny
    prompt = [5, 17, 33, 81, 120]
    free = hf_greedy(hf, prompt, 8)
    cases = {
        "force": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0}),
        "ban": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                              logit_bias=[(t, -100.0) for t in set(free)]),
        "allowed": SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                  allowed_token_ids=[200, 201, 202]),
        "bad1": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[[free[0]]]),
        "bad2": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                               bad_words_token_ids=[[free[0], free[1]]]),
    }
    cfg = ModelConfig(model=str(folder), device="cpu")
    executor = LocalExecutor(dataclasses.replace(cfg, block_size=BLOCK), num_blocks=32, progress=False)
    run = run_engine(executor, [(k, prompt, sp) for k, sp in cases.items()], block_size=BLOCK, num_blocks=32)
    assert run.tokens["force"][0] == [42] * 8
    assert not set(run.tokens["ban"][0]) & set(free)
    assert set(run.tokens["allowed"][0]) <= {200, 201, 202}
    assert free[0] not in run.tokens["bad1"][0]
    bad2 = run.tokens["bad2"][0]
    assert bad2[0] == free[0] and bad2[1] != free[1]  # the word's last token is banned right after its first
    assert all(bad2[i : i + 2] != free[:2] for i in range(len(bad2) - 1))


def test_bad_words_rule() -> None:
    assert banned_by_bad_words([[5], [1, 2, 3]], []) == [5]
    assert banned_by_bad_words([[5], [1, 2, 3]], [9, 1, 2]) == [5, 3]
    assert banned_by_bad_words([[1, 2, 3]], [1, 2, 9]) == []


@pytest.mark.parametrize("bad", [{"logit_bias": {3: 101.0}}, {"logit_bias": {-1: 1.0}},
                                 {"allowed_token_ids": []}, {"bad_words_token_ids": [[]]},
                                 {"prompt_logprobs": 21}])
def test_invalid_constraints_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
