"""An RL loop's engine controls (EngineCore): pause "keep" / "abort" / "wait" and resume, dropping the KV cache
(sleep), and new weights (``set_weights_version``): no block computed before an update is served after it."""

from __future__ import annotations

import pytest
from sched_fakes import Collected, collect, make_engine, req, run

from cbserve.scheduler.engine_core import EngineCore


def steps(engine: EngineCore, n: int, col: Collected) -> None:
    for _ in range(n):
        collect(engine.step(), col)
        engine.check_integrity()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pause_keep_holds_every_request_and_resume_loses_nothing(async_scheduling: bool) -> None:
    engine, executor = make_engine(async_scheduling=async_scheduling)
    engine.add_request(req("a", 5, max_tokens=12))
    col = Collected()
    for _ in range(4):
        collect(engine.step_with_batch_queue(), col)
    engine.pause("keep")
    engine.add_request(req("b", 6, max_tokens=5))  # arrives while paused: it waits
    while engine.batch_queue:  # what was in flight lands
        collect(engine.step_with_batch_queue(), col)
    landed, calls = {k: list(v) for k, v in col.tokens.items()}, len(executor.calls)
    assert not engine.has_work()
    for _ in range(5):  # paused: nothing runs
        collect(engine.step(), col)
    assert col.tokens == landed and len(executor.calls) == calls and 0 < len(landed[("a", 0)]) < 12
    engine.resume()
    run(engine, into=col)
    reference = run(_fresh(("a", 5, 12), ("b", 6, 5)))
    assert col.tokens == reference.tokens and col.reasons == {("a", 0): "length", ("b", 0): "length"}
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_pause_abort_ends_every_request_and_holds_new_ones() -> None:
    engine, _ = make_engine()
    engine.add_request(req("a", 5, max_tokens=20))
    engine.add_request(req("b", 5, max_tokens=20, n=2))
    col = Collected()
    steps(engine, 2, col)
    engine.pause("abort")
    engine.add_request(req("c", 4, max_tokens=3))
    steps(engine, 2, col)  # the aborts are reported, c does not start
    assert col.reasons == {("a", 0): "abort", ("b", 0): "abort", ("b", 1): "abort"}
    assert ("c", 0) not in col.tokens and not engine.has_work()
    engine.resume()
    run(engine, into=col)
    assert col.reasons[("c", 0)] == "length" and len(col.tokens[("c", 0)]) == 3


def test_pause_wait_finishes_started_requests_and_admits_none() -> None:
    engine, _ = make_engine(max_seqs=1)  # "b" waits behind "a"
    engine.add_request(req("a", 5, max_tokens=6))
    engine.add_request(req("b", 5, max_tokens=6))
    col = Collected()
    steps(engine, 2, col)
    engine.pause("wait")
    assert not engine.drained()
    for _ in range(20):
        if not engine.has_work():
            break
        collect(engine.step(), col)
    assert engine.drained() and col.reasons == {("a", 0): "length"} and ("b", 0) not in col.tokens
    engine.resume()
    run(engine, into=col)
    assert col.reasons[("b", 0)] == "length"


def test_pause_mode_is_checked() -> None:
    engine, _ = make_engine()
    with pytest.raises(ValueError, match="pause mode 'later'"):
        engine.pause("later")


def test_new_weights_never_serve_blocks_computed_before() -> None:
    engine, _ = make_engine(block_size=4)
    prompt = list(range(1, 18))
    engine.add_request(req("warm", prompt, max_tokens=2))
    run(engine)
    engine.add_request(req("long", list(range(1, 10)), max_tokens=40))  # runs across the update
    col = Collected()
    steps(engine, 3, col)
    engine.set_weights_version(7)
    assert not engine.scheduler.kv.pool.cached  # every hash forgotten, those of blocks in use too
    steps(engine, 8, col)
    assert not engine.scheduler.kv.pool.cached  # "long" computed its KV before: it registers no block
    engine.add_request(req("again", prompt, max_tokens=2))
    done = run(engine, into=col)
    hits = [r for r in done.results if any(o.req_id == "again" and o.finished for o in r.outputs)]
    final = [o for r in hits for o in r.outputs if o.req_id == "again"][-1]
    assert final.num_cached_tokens == 0 and final.weights_version == 7
    engine.add_request(req("twice", prompt, max_tokens=2))  # blocks computed after the update are served
    col2 = run(engine)
    assert col2.reasons[("twice", 0)] == "length"
    assert engine.scheduler.kv.pool.cached and not engine.scheduler.kv.stale


def test_drop_kv_preempts_running_sequences_which_finish_the_same() -> None:
    engine, _ = make_engine()
    engine.add_request(req("a", 5, max_tokens=10))
    engine.add_request(req("b", 7, max_tokens=10, n=2))
    col = Collected()
    steps(engine, 3, col)
    engine.pause("keep")
    engine.drop_kv()
    engine.check_integrity()
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not kv.pool.cached and not engine.scheduler.running
    engine.resume()
    run(engine, into=col)
    reference = run(_fresh(("a", 5, 10), ("b", 7, 10)))
    for key in (("a", 0), ("b", 0), ("b", 1)):
        assert col.tokens[key] == reference.tokens[key], key
        assert col.reasons[key] == "length"


def _fresh(*requests: tuple[str, int, int]) -> EngineCore:
    engine, _ = make_engine()
    for req_id, prompt, max_tokens in requests:
        engine.add_request(req(req_id, prompt, max_tokens=max_tokens, n=2 if req_id == "b" and prompt == 7 else 1))
    return engine
