"""Speculative decoding with a draft model (worker/runner/draft_model.py) through the offline ``LLM``, on a tiny random
Llama target: greedy outputs equal token for token those without speculation, with the target itself as
the draft (every draft accepted) and with a tinier random draft of the same vocabulary (almost every draft
rejected), across chunked prefill, prefix-cache hits and preemption by recompute (small blocks, a small
cache); seeded sampling stays reproducible; a draft whose vocabulary differs is refused at load."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from family_testlib import save_tokenizer
from worker_testlib import make_tiny_model

from cbserve import LLM, SamplingParams

ENGINE = {"device": "cpu", "max_model_len": 256, "block_size": 4, "max_num_batched_tokens": 24, "progress": False}


def _tiny_draft(folder: Path, vocab: int = 320) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    if vocab == 320:
        save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_draft")
    target = make_tiny_model(root / "target", "llama_gqa")
    save_tokenizer(target)
    return {"target": target, "draft": _tiny_draft(root / "draft"), "other_vocab": _tiny_draft(root / "v256", 256)}


def _prompts() -> list[list[int]]:
    """Mixed lengths (several chunks at 24 tokens a step), two sharing a 20-token prefix."""
    rng = random.Random(0)
    out = [[rng.randrange(3, 320) for _ in range(n)] for n in (5, 17, 30, 41)]
    shared = out[2][:20]
    return out + [shared + [7, 8, 9], shared + [9]]


def _spec(model: Path, k: int = 3) -> dict[str, object]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> list[list[int]]:
    llm = LLM(str(models["target"]), num_kv_blocks=128, **ENGINE)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def self_draft(models: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(str(models["target"]), speculative_config=_spec(models["target"]), num_kv_blocks=128, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(("draft", "num_blocks"), [("target", 128), ("draft", 128), ("target", 28), ("draft", 28)])
def test_greedy_with_a_draft_model_equals_greedy_decoding(
    models: dict[str, Path], reference: list[list[int]], draft: str, num_blocks: int
) -> None:
    """28 blocks of 4 tokens for 6 sequences of up to 81: preemption by recompute happens (max_model_len: one
    request must fit the cache)."""
    llm = LLM(
        str(models["target"]),
        speculative_config=_spec(models[draft]),
        num_kv_blocks=num_blocks,
        enable_prefix_caching=True,
        **{**ENGINE, "max_model_len": min(ENGINE["max_model_len"], 4 * num_blocks)},
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)]
        totals = llm.engine.totals
        llm.engine.scheduler.check_integrity()  # raises on a broken invariant
    finally:
        llm.shutdown()
    assert got == reference
    drafted, accepted = totals.spec_num_draft_tokens, totals.spec_num_accepted_tokens
    assert drafted > 100
    if draft == "target":
        assert accepted == drafted  # the draft is the target: every greedy draft holds
    else:
        assert accepted < drafted / 4  # a random draft: almost none
    assert totals.prefix_cache_hits > 0
    assert (totals.num_preemptions > 0) == (num_blocks == 28)


def test_seeded_sampling_with_a_draft_model_is_reproducible(self_draft: LLM) -> None:
    sp = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    prompts = _prompts()[:3]
    a = [o.outputs[0].token_ids for o in self_draft.generate(prompts, sp, use_tqdm=False)]
    before = self_draft.engine.totals.spec_num_accepted_tokens
    b = [o.outputs[0].token_ids for o in self_draft.generate(prompts, sp, use_tqdm=False)]
    assert a == b and all(len(t) == 24 for t in a)
    # p == q (the draft is the target): rejection sampling accepts every draft
    assert self_draft.engine.totals.spec_num_accepted_tokens - before > 30


def test_a_draft_with_another_vocabulary_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="vocabulary .*256 tokens.* differs from the target's .*320"):
        LLM(str(models["target"]), speculative_config=_spec(models["other_vocab"]), num_kv_blocks=64, **ENGINE)


def test_draft_model_needs_a_model_path() -> None:
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="unknown keys.*prompt_lookup_min"):
        LLM(
            speculative_config={
                "method": "draft_model",
                "model": "x",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 2,
            },
            **ENGINE,
        )
