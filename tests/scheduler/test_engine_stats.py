"""EngineCore's own step timing (the same for step() and an async schedule/execute/update driver), its
cumulative totals, and its LoRA stats (requests per adapter)."""

from __future__ import annotations

import time

import pytest
from sched_fakes import FakeExecutor, make_engine, req, run

from cbserve.scheduler import EngineTotals, LoRARequest, ModelRunnerOutput, QueueFullError, RequestRejectedError
from cbserve.scheduler.stats import LoRAStats

DELAY = 0.03


class SlowExecutor(FakeExecutor):
    def run(self, so):  # type: ignore[no-untyped-def]
        time.sleep(DELAY)
        return super().run(so)


def test_step_times_the_executor_hop() -> None:
    engine, ex = make_engine()
    engine.executor = SlowExecutor(ex.block_size, ex.num_blocks)
    engine.add_request(req("a", 5, max_tokens=3))
    s = engine.step().scheduler_stats
    assert s.execute_time_s >= DELAY
    assert 0 < s.schedule_time_s < DELAY
    assert s.forward_time_s == 0.001  # the worker's own figure


def test_async_driver_gets_the_same_stats_without_timing() -> None:
    """schedule -> (any wait: the executor hop) -> update_from_output."""
    engine, ex = make_engine()
    engine.add_request(req("a", 5, max_tokens=3))
    so = engine.schedule()
    time.sleep(DELAY)  # e.g. awaiting a Ray call, other coroutines running meanwhile
    out = ex.run(so)
    s = engine.update_from_output(so, out).scheduler_stats
    assert DELAY <= s.execute_time_s < DELAY + 1.0
    assert 0 < s.schedule_time_s < DELAY
    assert s.forward_time_s == 0.001


def test_empty_output_has_no_execute_time() -> None:
    engine, _ = make_engine()
    so = engine.schedule()
    assert so.is_empty
    time.sleep(0.01)
    s = engine.update_from_output(so, ModelRunnerOutput()).scheduler_stats
    assert s.execute_time_s == 0.0 and s.forward_time_s == 0.0
    assert engine.step().scheduler_stats.execute_time_s == 0.0


def test_update_without_schedule_reports_no_execute_time() -> None:
    engine, _ = make_engine()
    engine.add_request(req("a", 5, max_tokens=3))
    so = engine.schedule()
    engine.update_from_output(so, engine.executor.run(so))
    # a second update for the same output (no schedule() in between) has no hop to measure
    assert engine.update_from_output(so, ModelRunnerOutput()).scheduler_stats.execute_time_s == 0.0


def test_totals_count_admissions_refusals_aborts_steps_and_cache() -> None:
    engine, _ = make_engine(max_model_len=64, max_waiting=2, block_size=4)
    shared = list(range(1, 13))
    engine.add_request(req("a", shared, max_tokens=2))
    first = run(engine)
    engine.add_request(req("b", shared, max_tokens=2))  # 8 of its 12 prompt tokens hit the cache
    engine.add_request(req("c", 5, max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request(req("d", 5, max_tokens=2))
    with pytest.raises(RequestRejectedError):
        engine.add_request(req("e", 60, max_tokens=10))
    with pytest.raises(RequestRejectedError):
        engine.add_request(req("f", [], max_tokens=2))
    engine.abort_request("c")
    engine.abort_request("c")  # idempotent: counted once
    engine.abort_request("nobody")
    col = run(engine)
    t = engine.totals
    assert (t.num_admitted, t.num_queue_full, t.num_rejected, t.num_aborted) == (3, 1, 2, 1)
    assert t.num_steps == len(first.results) + len(col.results)
    assert t.prefix_cache_queries == 12 + 12 and t.prefix_cache_hits == 8
    assert col.results[-1].scheduler_stats.step_counter == t.num_steps


def test_totals_count_preemptions_and_continue_across_engines() -> None:
    engine, _ = make_engine(num_blocks=6, block_size=4)
    engine.add_request(req("x", 8, max_tokens=14))
    engine.add_request(req("y", 8, max_tokens=14))
    col = run(engine)
    assert engine.totals.num_preemptions == sum(r.scheduler_stats.num_preemptions for r in col.results) > 0
    carried = engine.totals
    engine2, ex2 = make_engine()
    engine2 = type(engine2)(engine2.config, ex2, clock=engine2.clock, totals=carried)
    engine2.add_request(req("z", 3, max_tokens=1))
    run(engine2)
    assert engine2.totals is carried and carried.num_admitted == 3


def test_totals_start_at_zero() -> None:
    assert make_engine()[0].totals == EngineTotals()


def test_the_engine_counts_requests_per_adapter_running_and_waiting() -> None:
    sql, chat = LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat")
    engine, _ = make_engine(max_loras=1, max_seqs=8)
    for rid, lora in (("a", sql), ("b", sql), ("c", chat), ("d", None)):
        r = req(rid, 5, max_tokens=4, lora=lora)
        engine.add_request(r)
    assert engine.current_stats().lora == LoRAStats(1, {}, {"sql": 2, "chat": 1})
    stats = engine.step().scheduler_stats.lora
    assert stats == LoRAStats(1, {"sql": 2}, {"chat": 1})  # max_loras 1: chat waits while sql runs
    assert make_engine()[0].current_stats().lora is None  # LoRA off: nothing to report
