"""Speculative decoding in the engine core: the n-gram proposer, the config, drafts scheduled as 1 + k
tokens within the budget, rollback of rejected drafts (blocks and computed tokens), refusals, stats."""

from __future__ import annotations

import pytest
from sched_fakes import make_engine, req, run

from cbserve.scheduler import NgramProposer, RequestRejectedError, SchedulerConfig, SpeculativeConfig
from cbserve.scheduler.config import EngineConfig

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def test_proposer_takes_the_longest_match_and_the_tokens_after_it() -> None:
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4))
    assert p.propose([1, 2, 3, 4, 5, 9, 9, 2, 3]) == [4, 5, 9]
    assert p.propose([1, 2, 3, 4, 5, 9, 9, 3]) == []  # a 1-token match is below prompt_lookup_min
    assert p.propose([5, 6, 7, 5, 6, 7, 5, 6]) == [7, 5, 6]  # the most recent of equally long matches
    # the longer match wins over a more recent shorter one
    assert p.propose([1, 2, 3, 10, 11, 0, 2, 3, 20, 21, 1, 2, 3]) == [10, 11, 0]
    assert p.propose([1, 2, 3, 4, 1, 2], max_drafts=1) == [3]
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # may run up to the end
    assert p.propose([7, 8]) == []


def test_config_refuses_what_is_not_built_or_invalid() -> None:
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2}) \
        == SpeculativeConfig("draft_model", 2, model="/x")
    with pytest.raises(ValueError, match='"draft_model" needs "model"'):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown method"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown keys.*model"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}
        )
    with pytest.raises(ValueError, match="needs 'method'"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 2})
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert cfg == SpeculativeConfig("ngram", 5, 2, 3)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(scheduler=SchedulerConfig(async_scheduling=True), speculative=cfg)


def test_drafts_are_scheduled_as_one_plus_k_tokens_and_rolled_back() -> None:
    engine, ex = make_engine(speculative=SPEC, copying=True, block_size=4, num_blocks=32)
    engine.add_request(req("a", [3, 4, 5, 6, 3, 4, 5, 6, 3], max_tokens=20))
    col = run(engine)
    spec_calls = [c for c in ex.calls if c.scheduled_spec_decode_tokens]
    assert spec_calls, "no drafts were proposed"
    for c in spec_calls:
        for rid, drafts in c.scheduled_spec_decode_tokens.items():
            assert 1 <= len(drafts) <= SPEC.num_speculative_tokens
            assert c.num_scheduled_tokens[rid] == 1 + len(drafts)
    assert ex.num_accepted > 0 and ex.num_accepted < ex.num_verified  # both outcomes happened
    assert len(col.tokens[("a", 0)]) == 20
    totals = engine.totals
    assert totals.spec_num_draft_tokens == ex.num_verified
    assert totals.spec_num_accepted_tokens == ex.num_accepted
    assert totals.spec_acceptance_rate == pytest.approx(ex.num_accepted / ex.num_verified)
    per_step = [r.scheduler_stats.spec_decode for r in col.results if r.scheduler_stats.spec_decode]
    assert sum(s.num_accepted_tokens for s in per_step) == ex.num_accepted
    assert sum(s.accepted_per_pos[0] for s in per_step if s.accepted_per_pos) <= sum(s.num_drafts for s in per_step)
    # fewer steps than tokens: speculation saved steps
    assert len(ex.calls) < 20


def test_rollback_frees_the_rejected_drafts_blocks() -> None:
    engine, ex = make_engine(speculative=SPEC, copying=True, block_size=1, num_blocks=64)
    engine.add_request(req("a", [3, 4, 5, 6, 3, 4, 5, 6, 3], max_tokens=24))
    kv = engine.scheduler.kv
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        seq = engine.scheduler.seqs.get("a")
        if seq is not None:  # block size 1: at most a block per token, nothing kept for rejected drafts
            assert len(seq.token_ids) - 1 <= len(kv.tables["a"]) <= len(seq.token_ids)
            assert ex.reqs["a"].blocks == kv.block_ids("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_same_tokens_with_and_without_speculation_under_preemption_and_n() -> None:
    outs = []
    for spec, blocks in ((None, 200), (SPEC, 14)):
        engine, ex = make_engine(speculative=spec, copying=True, block_size=2, num_blocks=blocks, max_batched=12)
        for i in range(5):
            engine.add_request(req(f"r{i}", [1, 2, 3, 1, 2, i, 7, 1][i:], max_tokens=12, n=1 + i % 3, seed=i))
        outs.append(run(engine).tokens)
        if spec is not None:
            assert any(c.preempted_req_ids for c in ex.calls) and ex.num_accepted > 0
    assert outs[0] == outs[1]


def test_abort_during_speculation_frees_everything() -> None:
    engine, _ = make_engine(speculative=SPEC, copying=True)
    engine.add_request(req("a", [3, 4, 5, 3, 4, 5, 3], max_tokens=30))
    engine.add_request(req("b", [3, 4, 5, 3, 4, 5, 3], max_tokens=30))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    run(engine)
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not engine.groups


def test_beam_search_is_refused_with_speculation() -> None:
    engine, _ = make_engine(speculative=SPEC)
    with pytest.raises(RequestRejectedError, match="beam search does not combine with speculative"):
        engine.add_request(req("a", 5, n=2, use_beam_search=True, temperature=0.0))
    assert engine.totals.num_rejected == 1


def test_no_drafts_past_the_length_limit_or_the_budget() -> None:
    engine, ex = make_engine(speculative=SPEC, copying=True, max_batched=3, block_size=4)
    engine.add_request(req("a", [3, 4, 5, 3, 4, 5, 3], max_tokens=5))
    run(engine)
    for c in ex.calls:
        assert c.total_num_scheduled_tokens <= 3
        for rid, drafts in c.scheduled_spec_decode_tokens.items():
            assert c.num_scheduled_tokens[rid] == 1 + len(drafts) <= 3
    seq_len = 7 + 5
    assert all(
        c.scheduled_cached_reqs[0].num_computed_tokens + c.num_scheduled_tokens["a"] <= seq_len
        for c in ex.calls if c.scheduled_cached_reqs
    )  # fmt: skip


def test_no_drafts_while_more_sequences_run_than_disable_by_batch_size() -> None:
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
    )
    engine, ex = make_engine(speculative=spec, copying=True)
    for i in range(3):
        engine.add_request(req(f"r{i}", [3, 4, 5, 3, 4, 5, 3], max_tokens=10 + 8 * i))
    run(engine)
    assert any(c.scheduled_spec_decode_tokens for c in ex.calls)  # once at most 2 run
    for c in ex.calls:
        if c.scheduled_spec_decode_tokens:
            assert len(c.num_scheduled_tokens) <= 2
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)
