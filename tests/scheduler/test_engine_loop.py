"""The engine's own pipelined loop (``EngineCore.step_with_batch_queue``) over an executor whose futures complete
later, as a remote worker's do: two steps in flight with async scheduling and one without, nothing applied
before its output is back, the same tokens as one step at a time, a failed step's error raised, and the steps
in flight cancelled when the worker group is gone."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from sched_fakes import Collected, FakeExecutor, collect, make_engine, req

from cbserve.scheduler import ModelRunnerOutput, SchedulerOutput


@dataclass
class DeferredExecutor(FakeExecutor):
    """Sends steps and returns pending futures; ``finish_oldest`` runs the oldest step, in order, as a remote
    worker would."""

    pending: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = field(default_factory=deque)

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        self.pending.append((so, future))
        return future

    def finish_oldest(self, error: Exception | None = None) -> None:
        so, future = self.pending.popleft()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(self.run(so))


def _deferred(async_scheduling: bool) -> tuple:
    engine, ex = make_engine(async_scheduling=async_scheduling)
    deferred = DeferredExecutor(ex.block_size, ex.num_blocks)
    engine.executor = deferred
    return engine, deferred


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_loop_keeps_its_depth_and_gives_the_tokens_of_single_steps(async_scheduling: bool) -> None:
    engine, ex = _deferred(async_scheduling)
    reference, _ = make_engine()
    for e in (engine, reference):
        for i in range(3):
            e.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=6))
    depth = 2 if async_scheduling else 1
    assert engine.max_in_flight == depth
    got = Collected()
    while engine.has_work():
        engine.submit_steps()
        sent = [so for so, _ in engine.batch_queue if not so.is_empty]  # an empty step is not sent
        assert len(sent) == len(ex.pending) and len(engine.batch_queue) <= depth  # sent, none applied yet
        if engine.has_unfinished_requests() and not engine.batch_queue[-1][0].is_empty:
            assert len(engine.batch_queue) == depth
        so, future = engine.batch_queue[0]
        if not so.is_empty:
            assert not future.done()
            ex.finish_oldest()
        collect(engine.complete_oldest_step(), got)
        engine.check_integrity()
    want = Collected()
    while reference.has_unfinished_requests():
        collect(reference.step(), want)
    assert got.tokens == want.tokens and got.reasons == want.reasons and len(got.tokens) == 3


def test_a_failed_step_raises_and_the_steps_in_flight_are_cancelled() -> None:
    engine, ex = _deferred(async_scheduling=True)
    engine.add_request(req("a", 6, max_tokens=8))
    engine.submit_steps()
    assert len(engine.batch_queue) == 2
    ex.finish_oldest(RuntimeError("rank 0 died"))
    with pytest.raises(RuntimeError, match="rank 0 died"):
        engine.complete_oldest_step()
    (_, second) = engine.batch_queue[0]
    engine.cancel_steps()
    assert second.cancelled() and not engine.batch_queue


def test_step_with_batch_queue_blocks_on_a_done_future_only() -> None:
    """With an executor that runs steps in place (the offline LLM's), the blocking loop turns one step a call."""
    engine, _ = make_engine(async_scheduling=True)
    engine.add_request(req("a", 6, max_tokens=4))
    results = []
    while engine.has_work():
        result = engine.step_with_batch_queue()
        assert result is not None
        results.append(result)
    assert sum(len(o.new_token_ids) for r in results for o in r.outputs) == 4
    assert engine.step_with_batch_queue() is None


def test_step_async_is_the_same_turn_on_an_event_loop() -> None:
    """The SchedulerActor's host: ``step_async`` awaits the oldest step's future while other tasks run (here: the
    worker finishing the step later), then applies it: the tokens of single steps."""
    import asyncio

    engine, ex = _deferred(async_scheduling=True)
    reference, _ = make_engine()
    for e in (engine, reference):
        for i in range(3):
            e.add_request(req(f"r{i}", 5 + 3 * i, max_tokens=6))
    waited: list[bool] = []

    async def wait(future: Future[ModelRunnerOutput] | None) -> None:
        waited.append(future is not None and not future.done())
        await asyncio.sleep(0)
        while future is not None and not future.done():
            ex.finish_oldest()  # the worker answers while the loop waits

    async def drive() -> Collected:
        got = Collected()
        while engine.has_work():
            result = await engine.step_async(wait)
            if result is not None:
                collect(result, got)
        return got

    got = asyncio.run(drive())
    want = Collected()
    while reference.has_unfinished_requests():
        collect(reference.step(), want)
    assert got.tokens == want.tokens and any(waited)
