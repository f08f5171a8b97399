"""Speculative decoding (n-gram) on the bundled SmolLM2 through the offline ``LLM``: greedy outputs equal
token for token those without speculation on input-grounded prompts (where drafts hit), with drafts
accepted and rejected; seeded sampling stays reproducible; n > 1 and logprobs work with drafts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cbserve import LLM, SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump!"
)
PROMPTS = [
    [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}],
    [{"role": "user", "content": "Rewrite the following text exactly: Sphinx of black quartz, judge my vow. "
      "The five boxing wizards jump quickly."}],
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE = {"device": "cpu", "max_model_len": 512, "max_num_batched_tokens": 512, "num_kv_blocks": 256, "progress": False}


@pytest.fixture(scope="module")
def llms() -> Iterator[tuple[LLM, LLM]]:
    base = LLM(**ENGINE)
    spec = LLM(speculative_config=SPEC, **ENGINE)
    yield base, spec
    base.shutdown()
    spec.shutdown()


def test_greedy_speculation_equals_greedy_decoding(llms: tuple[LLM, LLM]) -> None:
    base, spec = llms
    sp = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    want = base.chat(PROMPTS, sp, use_tqdm=False)
    before = spec.engine.totals.spec_num_draft_tokens, spec.engine.totals.spec_num_accepted_tokens
    got = spec.chat(PROMPTS, sp, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lg.token_id == lw.token_id and lg.logprob == pytest.approx(lw.logprob, abs=2e-3)
    totals = spec.engine.totals
    drafted = totals.spec_num_draft_tokens - before[0]
    accepted = totals.spec_num_accepted_tokens - before[1]
    assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    assert accepted / drafted > 0.5  # the model copies its prompt: most drafts hold


def test_seeded_sampling_with_speculation_is_reproducible(llms: tuple[LLM, LLM]) -> None:
    _, spec = llms
    sp = SamplingParams(temperature=0.8, seed=42, max_tokens=32, n=2)
    a = spec.chat(PROMPTS[0], sp, use_tqdm=False)[0]
    b = spec.chat(PROMPTS[0], sp, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert all(len(o.token_ids) > 0 for o in a.outputs)


def test_beam_search_is_refused_by_a_speculating_llm(llms: tuple[LLM, LLM]) -> None:
    _, spec = llms
    with pytest.raises(Exception, match="beam search does not combine with speculative decoding"):
        spec.generate("Hello", SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="speculative_config.*draft_model.*needs"):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **ENGINE)
