"""A request whose step raises fails alone, on the real runner (offline ``LLM`` over ``LocalExecutor``, a tiny
random Llama that fails when a trigger token runs: ``cbserve/worker/faults.py``, ``tests/tiny_llama.py``): its
output ends with finish reason "error" and the reason, every other prompt of the same batch gets exactly its
tokens of a run without it, and the engine's KV cache is empty after. The fault in the forward pass names no
request (the engine searches: scheduler/fault_isolation.py); the one in a structured-output matcher names its
sequence (the engine fails it at once)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_llama import TRIGGER, make_fault_model

from cbserve import LLM, SamplingParams
from cbserve.scheduler.requests.sampling_params import StructuredSpec

PROMPTS = [[1, 300 + 7 * i, 412, 5000 + 13 * i, 77, 901 + i][: 3 + i % 4] for i in range(7)]
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)


def _llm(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, max_num_seqs=16,
               kv_cache_memory_bytes=4 * 1024**2, progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def forward_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return _llm(make_fault_model(tmp_path_factory.mktemp("fault") / "forward", "forward"))


def _reference(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]


def _check_innocents(llm: LLM, outs: list, reference: list[list[int]]) -> None:
    got = [o.outputs[0] for o in outs if o.outputs[0].finish_reason != "error"]
    assert [g.token_ids for g in got] == reference and all(g.finish_reason == "length" for g in got)
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine.isolation.active


@pytest.mark.parametrize("where", [0, 3, 7])
def test_a_prompt_that_breaks_the_forward_pass_fails_alone(forward_llm: LLM, where: int) -> None:
    reference = _reference(forward_llm)
    poison = [1, 42, TRIGGER, 43]
    prompts = [*PROMPTS[:where], poison, *PROMPTS[where:]]
    outs = forward_llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    bad = outs[where].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == [] and "injected fault" in (bad.error or "")
    _check_innocents(forward_llm, outs, reference)


def test_a_request_that_breaks_mid_decode_fails_after_its_first_tokens(forward_llm: LLM) -> None:
    """``logit_bias`` makes it generate the trigger: its next decode step raises, after a token came out."""
    reference = _reference(forward_llm)
    params = [SamplingParams(**GREEDY)] * len(PROMPTS) + [SamplingParams(**GREEDY, logit_bias={TRIGGER: 100.0})]
    outs = forward_llm.generate([*PROMPTS, [1, 42, 43, 44]], params, use_tqdm=False)
    bad = outs[-1].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == [TRIGGER]
    _check_innocents(forward_llm, outs, reference)


def test_a_broken_grammar_matcher_fails_its_request_at_once(tmp_path: Path) -> None:
    llm = _llm(make_fault_model(tmp_path / "mask", "mask"))
    reference = _reference(llm)
    choice = SamplingParams(temperature=0.0, max_tokens=10, structured=StructuredSpec("choice", '["yes", "no"]'))
    outs = llm.generate([*PROMPTS, [1, 42, TRIGGER]], [SamplingParams(**GREEDY)] * len(PROMPTS) + [choice],
                        use_tqdm=False)
    bad = outs[-1].outputs[0]
    assert bad.finish_reason == "error" and "structured-output mask" in (bad.error or "")
    assert llm.engine.totals.num_failed_steps == 1  # named by the worker: no search
    _check_innocents(llm, outs, reference)
