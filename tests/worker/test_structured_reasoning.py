"""The reasoning gate of structured output (``StructuredSpec.reasoning_start`` / ``reasoning_end``) in the worker:
the grammar's matcher stays dormant (no bitmask) while the output reasons and constrains it from the token after
``</think>``; an output that may open its reasoning gets the grammar's first tokens plus ``<think>`` first; a spec
without a gate is unchanged. Then generation through a real EngineCore on a tiny Qwen3 whose greedy output is
known (``think_model.py``: "<think>Let me think</think>It is sunny."), with n > 1 forks, preemption and async
scheduling."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch
from think_model import EOS, ThinkModel, make_think_model
from worker_testlib import run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.sampling.sampler import SamplingRow
from cbserve.worker.sampling.structured import StructuredOutputs, load_grammar_tokenizer

pytest.importorskip("xgrammar")
VOCAB = 49160
CHOICES = ["yes", "no"]
PLAIN = StructuredSpec("choice", json.dumps(CHOICES))
PROMPT_TEXT = "<|im_start|>user\nyes or no?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory) -> ThinkModel:
    return make_think_model(tmp_path_factory.mktemp("think") / "think")


@pytest.fixture(scope="module")
def tok(think: ThinkModel) -> object:
    return load_grammar_tokenizer(think.folder)


def _allowed(mask: torch.Tensor | None, row: int = 0) -> set[int] | None:
    if mask is None:
        return None
    t = torch.arange(VOCAB)
    return set(((mask[row, t // 32] >> (t % 32)) & 1).nonzero().flatten().tolist())


def _mask(so: StructuredOutputs, spec: StructuredSpec, out: list[int], seq: str = "s",
          owner: object | None = None) -> set[int] | None:  # fmt: skip
    row = SamplingRow(SamplingParams(structured=spec), [7, 8, *out], 2)
    return _allowed(so.bitmask([(seq, owner if owner is not None else object(), row)]))


def test_the_gate_is_checked_and_leaves_the_grammar_key_alone() -> None:
    with pytest.raises(ValueError, match="reasoning_start needs reasoning_end"):
        StructuredSpec("regex", "a", reasoning_start=5)
    with pytest.raises(ValueError, match="reasoning_end must be >= 0"):
        StructuredSpec("regex", "a", reasoning_end=-1)
    assert StructuredSpec("regex", "a", 5, 6).grammar_key == StructuredSpec("regex", "a").grammar_key == ("regex", "a")


def test_the_grammar_waits_for_the_end_of_reasoning(think: ThinkModel, tok: object) -> None:
    so = StructuredOutputs(think.folder, VOCAB, [EOS])
    a, let, me, thought, b = think.chain
    gated = replace(PLAIN, reasoning_start=a, reasoning_end=b)  # qwen3: the output may open <think>
    inside = replace(PLAIN, reasoning_end=b)  # deepseek_r1: the prompt opened it
    assert so.compilers.get(gated) is so.compilers.get(PLAIN)  # one compiled grammar for both
    first = _mask(so, PLAIN, [])
    assert first and a not in first and let not in first and EOS not in first  # no gate: as before
    no = tok("no", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert _mask(so, gated, []) == first | {a}  # the answer, or the opening of the reasoning
    assert _mask(so, gated, [a]) is None and _mask(so, gated, [a, let, me, thought]) is None  # dormant
    assert _mask(so, gated, [a, let, me, thought, b]) == first  # the grammar starts after </think>
    assert _mask(so, gated, [a, let, b, *no]) == {EOS}  # ... and ends the answer
    assert _mask(so, gated, [no[0]]) == _mask(so, PLAIN, [no[0]])  # no reasoning: the grammar from token 0
    assert _mask(so, inside, []) is None and _mask(so, inside, [let, a, me]) is None
    assert _mask(so, inside, [let, me, b]) == first and _mask(so, inside, [b, *no]) == {EOS}
    # the same sequence step by step (one token behind each time, as the worker appends its samples) ...
    owner, out = object(), [a, let, me, thought, b, *no]
    masks = [_mask(so, gated, out[:k], "seq", owner) for k in range(len(out) + 1)]
    assert masks == [first | {a}, None, None, None, None, first, *masks[6:]] and masks[-1] == {EOS}
    # ... preempted and resumed (a new owner, fewer tokens): replayed from its tokens
    assert _mask(so, gated, out[:2], "seq", object()) is None and "seq" in so.matchers


def test_a_batch_masks_only_the_answering_rows(think: ThinkModel) -> None:
    so = StructuredOutputs(think.folder, VOCAB, [EOS])
    a, let, _, _, b = think.chain
    gated = replace(PLAIN, reasoning_start=a, reasoning_end=b)
    first = _mask(so, PLAIN, [])
    fork = object()  # n > 1 at its fork point: one matcher, several rows
    rows = [("r", object(), SamplingRow(SamplingParams(structured=gated), [7, a, let], 1)),
            ("f", fork, SamplingRow(SamplingParams(structured=gated), [7], 1)),
            ("f", fork, SamplingRow(SamplingParams(structured=gated), [7], 1)),
            ("p", object(), SamplingRow(SamplingParams(), [7, 9], 1)),
            ("q", object(), SamplingRow(SamplingParams(structured=PLAIN), [7], 1))]  # fmt: skip
    mask = so.bitmask(rows)
    assert mask is not None and mask.shape[0] == 5
    assert [_allowed(mask, j) for j in range(5)] == [set(range(VOCAB)), first | {a}, first | {a}, set(range(VOCAB)),
                                                     first]  # fmt: skip
    assert so.bitmask(rows[:1] + rows[3:4]) is None  # every constrained row reasoning: no mask at all


def _run(folder: object, num_blocks: int, requests: list, async_scheduling: bool = False) -> object:
    cfg = ModelConfig(model=str(folder), max_model_len=256, device="cpu")
    ex = LocalExecutor(dataclasses.replace(cfg, block_size=4, max_num_batched_tokens=64, max_num_seqs=8),
                       num_blocks=num_blocks, progress=False)
    try:
        return run_engine(ex, requests, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=64,
                          async_scheduling=async_scheduling)  # fmt: skip
    finally:
        ex.shutdown()


def test_generation_reasons_freely_then_follows_the_grammar(think: ThinkModel, tok: object) -> None:
    """Greedy: the chain's reasoning (which the grammar forbids) then an answer in the grammar, ended by EOS;
    the same request without a gate answers in the grammar from its first token; seeded n = 2 forks at the
    first token. Equal outputs synchronously, with async scheduling and under preemption."""
    a, b = think.chain[0], think.chain[-1]
    prompt = tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    gated = replace(PLAIN, reasoning_start=a, reasoning_end=b)
    inside = replace(PLAIN, reasoning_end=b)
    reqs = [("g", prompt, SamplingParams(temperature=0.0, max_tokens=30, structured=gated)),
            ("n2", prompt, SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=30, structured=gated)),
            ("in", prompt, SamplingParams(temperature=0.0, max_tokens=30, structured=inside)),
            ("plain", prompt, SamplingParams(temperature=0.0, max_tokens=30, structured=PLAIN)),
            ("cut", prompt, SamplingParams(temperature=0.0, max_tokens=3, structured=gated)),
            ("free", prompt, SamplingParams(temperature=0.0, max_tokens=20))]  # fmt: skip
    sync = _run(think.folder, 256, reqs)
    assert _run(think.folder, 256, reqs, async_scheduling=True).tokens == sync.tokens
    tight = _run(think.folder, 14, reqs, async_scheduling=True)
    assert tight.num_preemptions > 0 and tight.tokens == sync.tokens
    n = len(think.chain)
    for rid, i in (("g", 0), ("n2", 0), ("n2", 1), ("in", 0)):
        toks = sync.tokens[rid][i]
        assert tuple(toks[:n]) == think.chain, (rid, tok.decode(toks))  # type: ignore[attr-defined]
        assert tok.decode(toks[n:-1]) in CHOICES and toks[-1] == EOS and sync.finish[rid][i] == "stop"  # type: ignore[attr-defined]
    plain = sync.tokens["plain"][0]
    assert tok.decode(plain[:-1]) in CHOICES and plain[-1] == EOS  # type: ignore[attr-defined]
    assert sync.tokens["cut"][0] == list(think.chain[:3]) and sync.finish["cut"][0] == "length"  # both count
    assert sync.tokens["free"][0] == [*think.chain, *think.answer] and sync.finish["free"][0] == "stop"
