"""EngineCore: admission errors, stop conditions, abort/finish from outside, n > 1, best_of, stats."""

from __future__ import annotations

import pytest
from sched_fakes import (
    EOS,
    Collected,
    FakeClock,
    collect,
    expected_tokens,
    logprob_of,
    make_engine,
    next_token,
    req,
    run,
)

from cbserve.scheduler import DuplicateRequestError, QueueFullError, RequestRejectedError


# ---- admission ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_kw", "match"),
    [
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": 100, "max_tokens": 29}, r"prompt \(100 tokens\) \+ max_tokens \(29\) = 129 exceeds"),
        ({"prompt": 128, "max_tokens": None}, "no room to generate"),
        ({"prompt": 60, "max_tokens": 10}, "needs 18 KV cache blocks .* only 16 blocks"),
    ],
)
def test_rejections_with_clear_reasons(request_kw: dict, match: str) -> None:
    engine, _ = make_engine(num_blocks=16, block_size=4, max_model_len=128)
    with pytest.raises(RequestRejectedError, match=match):
        engine.add_request(req("a", **request_kw))
    assert not engine.has_unfinished_requests()
    res = engine.step()
    assert len(res.iteration_stats.rejected_reasons) == 1


def test_fits_exactly_in_whole_cache_is_accepted() -> None:
    engine, _ = make_engine(num_blocks=4, block_size=4, max_model_len=64)
    engine.add_request(req("a", 10, max_tokens=7))  # 16 KV slots: the last token needs none
    col = run(engine)
    assert col.reasons[("a", 0)] == "length" and len(col.tokens[("a", 0)]) == 7


def test_duplicate_and_queue_full() -> None:
    engine, _ = make_engine(max_waiting=2)
    engine.add_request(req("a", 3))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(req("a", 3))
    engine.add_request(req("b", 3))
    with pytest.raises(QueueFullError):
        engine.add_request(req("c", 3))
    engine.step()  # a and b admitted: the queue has room again
    engine.add_request(req("c", 3))
    assert "c" in engine.groups and engine.totals.num_queue_full == 1
    engine2, _ = make_engine()
    engine2.add_request(req("x", 3, n=2))
    with pytest.raises(DuplicateRequestError):
        engine2.add_request(req("x#1", 3))  # would clash with x's second sequence


# ---- stop conditions -----------------------------------------------------------------------------
def test_eos_stops_and_ignore_eos() -> None:
    engine, _ = make_engine(eos_after={"a": 3, "b": 3})
    ra = req("a", 5, max_tokens=10)
    engine.add_request(ra)
    engine.add_request(req("b", 5, max_tokens=10, ignore_eos=True))
    col = run(engine)
    assert col.tokens[("a", 0)] == expected_tokens(ra.prompt_token_ids, 10, eos_at=3)
    assert col.tokens[("a", 0)][-1] == EOS and col.reasons[("a", 0)] == "stop"
    assert len(col.tokens[("b", 0)]) == 10 and col.reasons[("b", 0)] == "length"


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    engine, _ = make_engine(eos_after={"a": 2})
    engine.add_request(req("a", 5, max_tokens=10, min_tokens=2))
    col = run(engine)
    assert len(col.tokens[("a", 0)]) == 10  # EOS at token 2 is within min_tokens: ignored
    engine, _ = make_engine(eos_after={"a": 3})
    engine.add_request(req("a", 5, max_tokens=10, min_tokens=2))
    col = run(engine)
    assert len(col.tokens[("a", 0)]) == 3 and col.reasons[("a", 0)] == "stop"
    r = req("s", 5, max_tokens=10)
    toks = expected_tokens(r.prompt_token_ids, 10)
    engine, _ = make_engine()
    engine.add_request(req("s", r.prompt_token_ids, max_tokens=10, stop_token_ids=[toks[1]]))
    engine.add_request(req("t", r.prompt_token_ids, max_tokens=10, stop_token_ids=[toks[1]], min_tokens=2))
    col = run(engine)
    assert col.tokens[("s", 0)] == toks[:2] and col.reasons[("s", 0)] == "stop"
    assert col.tokens[("t", 0)][:2] == toks[:2] and len(col.tokens[("t", 0)]) > 2


def test_max_model_len_caps_when_max_tokens_unset() -> None:
    engine, _ = make_engine(max_model_len=12)
    engine.add_request(req("a", 8, max_tokens=None))
    col = run(engine)
    assert len(col.tokens[("a", 0)]) == 4 and col.reasons[("a", 0)] == "length"


# ---- abort / finish from outside ------------------------------------------------------------------
@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_abort_frees_blocks_and_reports(when: str) -> None:
    engine, ex = make_engine(max_batched=4, max_seqs=1)
    engine.add_request(req("other", 3, max_tokens=30))
    engine.add_request(req("a", 10, max_tokens=5))
    if when != "waiting":
        engine.abort_request("other")
        engine.step()
        engine.step()  # a: 4 of 10 prompt tokens computed
    if when == "decoding":
        for _ in range(3):
            engine.step()
        assert engine.groups["a"].seqs[0].num_output_tokens >= 1
    engine.abort_request("a")
    engine.abort_request("a")  # idempotent
    engine.check_integrity()
    res = engine.step()
    outs = [o for o in res.outputs if o.req_id == "a"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "abort"
    fin = [f.finish_reason for f in res.iteration_stats.finished if f.times.num_prompt_tokens == 10]
    assert fin == ["abort"]
    run(engine)
    engine.add_request(req("z", 3, max_tokens=1))
    run(engine)
    dropped = set().union(*(c.finished_req_ids for c in ex.calls))
    assert ("a" in dropped) == (when != "waiting")
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
    assert not engine.has_unfinished_requests()


def test_abort_unknown_is_noop_and_finish_request() -> None:
    engine, _ = make_engine()
    engine.abort_request("nope")
    engine.add_request(req("a", 4, max_tokens=20))
    engine.step()
    engine.step()
    engine.finish_request("a", 0, "stop")
    engine.finish_request("a", 0, "stop")
    with pytest.raises(ValueError):
        engine.finish_request("a", 0, "bogus")
    res = engine.step()
    (out,) = res.outputs
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []
    assert not engine.has_unfinished_requests()


# ---- n > 1, best_of -----------------------------------------------------------------------------
def test_n_fork_copy_on_write_exact_copies() -> None:
    engine, ex = make_engine(block_size=4, num_blocks=16)
    r = req("a", 6, max_tokens=4, n=3, seed=7)  # block 0 full, block 1 holds 2 prompt tokens
    engine.add_request(r)
    col = Collected()
    collect(engine.step(), col)
    (new,) = ex.calls[0].scheduled_new_reqs
    assert new.num_samples == 3 and new.seed == 7 and new.block_ids == [0, 1]
    collect(engine.step(), col)
    so = ex.calls[1]
    # the parent (held by the worker) writes block 1 in place; the children get copies
    assert so.block_copies == [(1, 2), (1, 3)]
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a"]
    children = {n.req_id: n for n in so.scheduled_new_reqs}
    assert set(children) == {"a#1", "a#2"}
    assert children["a#1"].block_ids == [0, 2] and children["a#2"].block_ids == [0, 3]
    assert children["a#1"].seed == 8 and children["a#2"].seed == 9
    assert children["a#1"].num_samples == 1 and children["a#1"].num_computed_tokens == 6
    run(engine, into=col)
    for i in range(3):
        toks = col.tokens[("a", i)]
        assert len(toks) == 4 and col.reasons[("a", i)] == "length"
        assert toks[0] == next_token(r.prompt_token_ids, i)
    assert len({tuple(col.tokens[("a", i)]) for i in range(3)}) == 3


def test_n_fork_when_prompt_ends_on_block_boundary_has_no_copies() -> None:
    engine, ex = make_engine(block_size=4)
    engine.add_request(req("a", 8, max_tokens=3, n=2))
    run(engine)
    assert all(not c.block_copies for c in ex.calls)


def test_n_children_finishing_at_fork_are_never_sent() -> None:
    engine, ex = make_engine()
    engine.add_request(req("a", 5, max_tokens=1, n=4))
    col = run(engine)
    assert sorted(col.reasons) == [("a", i) for i in range(4)]
    engine.add_request(req("b", 3, max_tokens=1))
    run(engine)
    sent = {n.req_id for c in ex.calls for n in c.scheduled_new_reqs}
    assert sent == {"a", "b"}
    assert set().union(*(c.finished_req_ids for c in ex.calls)) == {"a"}


def test_n_with_preemption_matches_unpreempted() -> None:
    requests = [req("a", 6, max_tokens=10, n=3), req("b", 7, max_tokens=10, n=2)]
    big, _ = make_engine(num_blocks=64)
    for r in requests:
        big.add_request(r)
    ref = run(big)
    small, ex = make_engine(num_blocks=9)
    for r in requests:
        small.add_request(r)
    col = run(small)
    assert any(c.preempted_req_ids for c in ex.calls)
    assert col.tokens == ref.tokens


def test_best_of_returns_n_best_by_cumulative_logprob() -> None:
    engine, ex = make_engine()
    r = req("a", 5, max_tokens=4, n=2, best_of=4)
    engine.add_request(r)
    col = run(engine)
    assert ex.calls[0].scheduled_new_reqs[0].sampling_params.logprobs == 0  # asked internally
    assert ex.calls[0].scheduled_new_reqs[0].num_samples == 4
    final = [col.final[("a", i)] for i in range(2)]
    assert sorted(col.reasons) == [("a", 0), ("a", 1)]
    # recompute all 4 candidates' scores with the fake model
    cands = []
    for i in range(4):
        toks = list(r.prompt_token_ids)
        out = []
        for k in range(4):
            t = next_token(toks, i if k == 0 else 0)
            out.append(t)
            toks.append(t)
        cands.append((sum(logprob_of(t) for t in out), out))
    cands.sort(key=lambda c: c[0], reverse=True)
    assert final == [cands[0][1], cands[1][1]]
    # every result was only reported at the end, with no logprobs since the user asked none
    finals = [o for res in col.results for o in res.outputs]
    assert len(finals) == 2 and all(o.finished and o.new_logprobs is None for o in finals)


def test_logprobs_are_streamed_when_asked() -> None:
    engine, _ = make_engine()
    engine.add_request(req("a", 5, max_tokens=3, logprobs=1))
    col = run(engine)
    outs = [o for res in col.results for o in res.outputs]
    assert all(len(o.new_logprobs) == 1 for o in outs)
    assert outs[-1].cumulative_logprob == pytest.approx(sum(logprob_of(t) for t in col.tokens[("a", 0)]))


# ---- times and stats ------------------------------------------------------------------------------
def test_request_times_with_fake_clock() -> None:
    clock = FakeClock(10.0)
    engine, _ = make_engine(clock=clock, max_batched=4)
    engine.add_request(req("a", 6, max_tokens=3))
    clock.advance(1.0)
    results = []
    while engine.has_unfinished_requests():
        results.append(engine.step())
        clock.advance(0.5)
    its = [r.iteration_stats for r in results]
    assert [i.ttfts for i in its][1] == [pytest.approx(1.5)]  # arrival 10, first token at 11.5
    assert sum(len(i.inter_token_latencies) for i in its) == 2
    assert all(x == pytest.approx(0.5) for i in its for x in i.inter_token_latencies)
    (fin,) = its[-1].finished
    t = fin.times
    assert t.arrival == 10.0 and t.first_scheduled == 11.0 and t.first_token == 11.5
    assert t.finished == 12.5 and t.num_generation_tokens == 3 and t.queue_time == 1.0
    assert t.tpot == pytest.approx(0.5) and its[1].num_prompt_tokens == 6


@pytest.mark.parametrize("ordering", ["fcfs", "priority"])
def test_a_full_waiting_queue_refuses_new_requests_alone(ordering: str) -> None:
    """The waiting queue refuses a new request's sequence when it holds ``max_waiting``: the refused request leaves
    nothing in the engine (its id is free again), and a preempted sequence always goes back to the queue."""
    from cbserve.scheduler.waiting_queue import make_waiting_queue

    engine, _ = make_engine(max_waiting=1, ordering=ordering)
    engine.add_request(req("a", 3))
    with pytest.raises(QueueFullError):
        engine.add_request(req("b", 3))
    assert set(engine.groups) == {"a"} and set(engine.scheduler.seqs) == {"a"} and len(engine.scheduler.waiting) == 1
    queue = make_waiting_queue(ordering, 1)
    first, back = engine.scheduler.seqs["a"], engine.groups["a"].seqs[0]
    queue.add(first)
    with pytest.raises(QueueFullError):
        queue.add(first)
    queue.add_front(back)  # a preempted sequence: never refused
    assert len(queue) == 2
    run(engine)
    engine.add_request(req("b", 3))  # the id was never taken
    col = run(engine)
    assert col.reasons[("b", 0)] == "length"
