"""The continuous-batching rule, chunked prefill, caps, preemption and resume."""

from __future__ import annotations

from sched_fakes import Collected, Overlapped, collect, expected_tokens, make_engine, req, run

from cbserve.scheduler import RequestStatus


def scheduled(so: object) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)  # type: ignore[attr-defined]


def test_single_request_tokens_and_protocol() -> None:
    engine, ex = make_engine()
    r = req("a", 6, max_tokens=5)
    engine.add_request(r)
    col = run(engine)
    assert col.tokens[("a", 0)] == expected_tokens(r.prompt_token_ids, 5)
    assert col.reasons[("a", 0)] == "length"
    first, second = ex.calls[0], ex.calls[1]
    assert [n.req_id for n in first.scheduled_new_reqs] == ["a"] and scheduled(first) == {"a": 6}
    assert first.scheduled_new_reqs[0].block_ids == [0, 1]
    (cached,) = second.scheduled_cached_reqs
    # the worker keeps the token it sampled: the scheduler sends back none (ModelRunner._keep_samples)
    assert cached.new_token_ids == [] and cached.num_computed_tokens == 6
    assert cached.new_block_ids == [] and scheduled(second) == {"a": 1}
    assert ex.calls[2].scheduled_cached_reqs[0].new_block_ids == []
    assert ex.calls[3].scheduled_cached_reqs[0].new_block_ids == [2]  # position 8 opens block 2
    # the worker is told to drop the finished sequence with the next non-empty output
    engine.add_request(req("b", 3, max_tokens=1))
    engine.step()
    assert ex.calls[-1].finished_req_ids == {"a"}
    assert engine.scheduler.kv.num_free_blocks == 64


def test_chunked_prefill_split_sizes_and_running_first() -> None:
    engine, ex = make_engine(max_batched=4)
    engine.add_request(req("a", 10, max_tokens=3))
    engine.add_request(req("b", 3, max_tokens=2))
    for _ in range(3):
        engine.step()
    assert [scheduled(c) for c in ex.calls] == [{"a": 4}, {"a": 4}, {"a": 2, "b": 2}]
    engine.step()
    assert scheduled(ex.calls[-1]) == {"a": 1, "b": 1}  # a decodes first, b's last prompt chunk
    run(engine)
    assert ex.calls[-1].total_num_scheduled_tokens <= 4


def test_chunk_that_does_not_finish_the_prompt_is_not_sampled() -> None:
    engine, _ = make_engine(max_batched=4)
    engine.add_request(req("a", 6, max_tokens=2))
    res = engine.step()
    assert res.outputs == [] and res.scheduler_stats.num_prefill_tokens == 4
    res = engine.step()
    assert len(res.outputs) == 1 and res.iteration_stats.num_generation_tokens == 1


def test_no_chunking_waits_for_whole_prompt_budget() -> None:
    engine, ex = make_engine(max_batched=16, max_model_len=16, chunked=False)
    engine.add_request(req("a", 10, max_tokens=4))
    engine.add_request(req("b", 10, max_tokens=4))
    engine.step()
    assert scheduled(ex.calls[0]) == {"a": 10}
    engine.step()
    assert scheduled(ex.calls[1]) == {"a": 1, "b": 10}


def test_max_num_seqs_cap() -> None:
    engine, ex = make_engine(max_seqs=2)
    for i in range(4):
        engine.add_request(req(f"r{i}", 3, max_tokens=3))
    engine.step()
    assert set(scheduled(ex.calls[0])) == {"r0", "r1"}
    res = engine.step()
    assert res.scheduler_stats.num_running == 2 and res.scheduler_stats.num_waiting == 2
    col = run(engine)
    assert all(len(c.num_scheduled_tokens) <= 2 for c in ex.calls)
    assert len(col.reasons) == 4


def test_token_budget_shared_between_decode_and_prefill() -> None:
    engine, ex = make_engine(max_batched=8)
    engine.add_request(req("a", 4, max_tokens=10))
    engine.step()
    engine.add_request(req("b", 20, max_tokens=2))
    engine.step()
    assert scheduled(ex.calls[1]) == {"a": 1, "b": 7}


def test_preemption_recompute_same_tokens_as_unpreempted() -> None:
    prompts = {f"r{i}": req(f"r{i}", 7 + i, max_tokens=12) for i in range(4)}
    big, _ = make_engine(num_blocks=64)
    for r in prompts.values():
        big.add_request(r)
    ref = run(big)
    small, ex = make_engine(num_blocks=12, caching=False)
    for r in prompts.values():
        small.add_request(r)
    col = run(small)
    assert col.tokens == ref.tokens and col.reasons == ref.reasons
    preempted = set().union(*(c.preempted_req_ids for c in ex.calls))
    assert preempted, "the small cache should have forced a preemption"
    assert "r0" not in preempted  # the earliest arrival is never the victim under FCFS
    # a resumed request is re-sent as new with all its tokens (prompt + generated so far)
    victim = sorted(preempted)[-1]
    idx = next(i for i, c in enumerate(ex.calls) if victim in c.preempted_req_ids)
    resend = next(n for c in ex.calls[idx:] for n in c.scheduled_new_reqs if n.req_id == victim)
    assert len(resend.token_ids) > resend.num_prompt_tokens and resend.num_computed_tokens == 0
    assert sum(r.scheduler_stats.num_preemptions for r in col.results) >= len(preempted)


def test_preempted_request_goes_to_front_and_is_marked() -> None:
    engine, _ = make_engine(num_blocks=6, block_size=4, max_batched=64)
    engine.add_request(req("a", 8, max_tokens=12))
    engine.add_request(req("b", 8, max_tokens=12))
    engine.step()  # a: blocks 0,1; b: blocks 2,3
    engine.add_request(req("c", 4, max_tokens=4))
    states = []
    for _ in range(6):
        res = engine.step()
        states.append(res.scheduler_stats.num_preempted_waiting)
        engine.check_integrity()
        seq_b = engine.groups["b"].seqs[0]
        if seq_b.status is RequestStatus.PREEMPTED:
            assert engine.scheduler.waiting.peek() is seq_b  # ahead of c
            break
    assert max(states) == 1
    run(engine)


def test_prefix_cache_hit_restores_computed_tokens_on_resume() -> None:
    engine, ex = make_engine(num_blocks=8, block_size=4, max_batched=64)
    engine.add_request(req("a", 9, max_tokens=20))
    engine.add_request(req("b", 9, max_tokens=20))
    col = run(engine)
    resumed = [n for c in ex.calls for n in c.scheduled_new_reqs if len(n.token_ids) > n.num_prompt_tokens]
    assert resumed and any(n.num_computed_tokens > 0 for n in resumed)
    big, _ = make_engine(num_blocks=64)
    big.add_request(req("a", 9, max_tokens=20))
    big.add_request(req("b", 9, max_tokens=20))
    assert run(big).tokens == col.tokens


def test_prefix_cache_stats_and_hits_across_requests() -> None:
    engine, ex = make_engine(block_size=4)
    prompt = list(range(1, 14))
    engine.add_request(req("a", prompt, max_tokens=2))
    run(engine)
    engine.add_request(req("b", prompt, max_tokens=2))
    res = engine.step()
    assert ex.calls[-1].scheduled_new_reqs[0].num_computed_tokens == 12
    assert res.scheduler_stats.prefix_cache_queries == 13 and res.scheduler_stats.prefix_cache_hits == 12
    assert scheduled(ex.calls[-1]) == {"b": 1}
    col = run(engine)
    assert col.reasons[("b", 0)] == "length"


def test_priority_ordering_admits_and_preempts_by_priority() -> None:
    engine, ex = make_engine(ordering="priority", max_seqs=1)
    engine.add_request(req("low", 3, max_tokens=2, priority=5))
    engine.add_request(req("high", 3, max_tokens=2, priority=1))
    engine.step()
    assert set(scheduled(ex.calls[0])) == {"high"}
    run(engine)
    engine2, ex2 = make_engine(ordering="priority", num_blocks=6, block_size=4)
    engine2.add_request(req("x", 8, max_tokens=14, priority=0))
    engine2.add_request(req("y", 8, max_tokens=14, priority=-1))  # better priority, later arrival
    run(engine2)
    preempted = set().union(*(c.preempted_req_ids for c in ex2.calls))
    assert preempted == {"x"}


def test_num_preempted_and_stats_fields() -> None:
    engine, _ = make_engine()
    engine.add_request(req("a", 5, max_tokens=3))
    res = engine.step()
    s = res.scheduler_stats
    assert s.batch_size == 1 and s.num_prefill_tokens == 5 and s.num_decode_tokens == 0
    assert s.num_kv_blocks == 64 and s.num_free_kv_blocks == 62 and s.step_counter == 1
    assert s.forward_time_s == 0.001 and s.schedule_time_s > 0
    res = engine.step()
    assert res.scheduler_stats.num_decode_tokens == 1


def test_async_scheduling_schedules_the_next_token_before_the_sample_is_back() -> None:
    engine, ex = make_engine(async_scheduling=True)
    r = req("a", 6, max_tokens=5)
    engine.add_request(r)
    first = engine.schedule()  # the prompt: its last row is sampled
    out1 = ex.run(first)
    second = engine.schedule()  # scheduled before out1 is applied: one token, whose id the worker has
    assert scheduled(second) == {"a": 1}
    (cached,) = second.scheduled_cached_reqs
    assert cached.new_token_ids == [] and cached.num_computed_tokens == 6
    seq = engine.scheduler.seqs["a"]
    assert (seq.num_pending, seq.num_computed_tokens, seq.num_tokens) == (2, 7, 6)
    engine.check_integrity()
    out2 = ex.run(second)
    col = Collected()
    collect(engine.update_from_output(first, out1), col)
    collect(engine.update_from_output(second, out2), col)
    assert col.tokens[("a", 0)] == expected_tokens(r.prompt_token_ids, 5)[:2]
    assert seq.num_pending == 0 and seq.num_tokens == 8
    driver = Overlapped(engine)
    run(engine, driver=driver, into=col)
    assert col.tokens[("a", 0)] == expected_tokens(r.prompt_token_ids, 5) and col.reasons[("a", 0)] == "length"
    # the last token is never computed ahead: no step past max_tokens was scheduled
    assert sum(scheduled(c).get("a", 0) for c in ex.calls) == 6 + 4
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_async_scheduling_caches_the_prompt_of_a_request_that_ends_on_its_first_token() -> None:
    hits = []
    for overlap in (False, True):
        engine, _ = make_engine(async_scheduling=overlap, block_size=4, eos_after={"r0": 1})
        prefix = list(range(100, 118))
        for i in range(3):
            engine.add_request(req(f"r{i}", [*prefix, i], max_tokens=2))
            run(engine, driver=Overlapped(engine) if overlap else None)
        hits.append(engine.totals.prefix_cache_hits)
    assert hits == [32, 32]  # r1 and r2 each reuse the 4 full prefix blocks r0 left behind
