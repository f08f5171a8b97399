"""A step that raises on a live worker fails its culprit alone (scheduler/fault_isolation.py): over a fake worker
that raises whenever a poisoned request runs (after a number of its tokens, as a fault mid-decode would), the
culprit ends with finish reason "error" and its ``RequestFailure``, every other request gets exactly the tokens of
a run without the culprit, and afterwards every KV block is free and the worker holds no request. Named culprits
fail at once; unnamed ones are found by the search, within its budget of failed steps."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from sched_fakes import Collected, FakeExecutor, Overlapped, make_engine, req, run

from cbserve.scheduler import EngineCore, ModelRunnerOutput, SchedulerOutput
from cbserve.scheduler.engine_core import MAX_FAILED_STEPS_IN_A_ROW
from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.fault_isolation import FaultIsolation


@dataclass
class FaultyExecutor(FakeExecutor):
    """The fake worker, raising for ``poison`` requests (id -> the output tokens they must have first) like the
    real one: the step's state changes are made (worse than the real worker: its samples are even kept), then it
    raises, naming the culprit when ``named``; steps of a failed epoch are skipped (their removals applied).
    ``transient``: that many failures, then none."""

    poison: dict[str, int] = field(default_factory=dict)
    named: bool = False
    transient: int | None = None
    failed_epoch: int = -1
    num_failures: int = 0

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.run(so))
        except StepFailedError as e:  # a real executor's future holds the step's error
            future.set_exception(e)
        return future

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        gone = so.finished_req_ids | so.preempted_req_ids
        if so.epoch <= self.failed_epoch:
            for rid in gone:
                self.reqs.pop(rid, None)
            raise StepFailedError("skipped", skipped=True)
        held = {r for r in gone if r in self.reqs}  # an id sent again after a failure may be gone already
        out = super().run(dataclasses.replace(so, finished_req_ids=held & so.finished_req_ids,
                                              preempted_req_ids=held & so.preempted_req_ids))
        bad = [rid for rid in so.num_scheduled_tokens if self._poisoned(rid)]
        if bad and (self.transient is None or self.num_failures < self.transient):
            self.num_failures += 1
            self.failed_epoch = so.epoch
            raise StepFailedError("InjectedFault: boom", culprits=bad if self.named else ())
        return out

    def _poisoned(self, rid: str) -> bool:
        after = self.poison.get(rid.split("#")[0])
        w = self.reqs.get(rid)
        return after is not None and w is not None and len(w.tokens) - w.num_prompt >= after


def _engine(poison: dict[str, int], named: bool = False, transient: int | None = None,
            async_scheduling: bool = True) -> tuple[EngineCore, FaultyExecutor]:
    engine, ex = make_engine(async_scheduling=async_scheduling, num_blocks=96)
    faulty = FaultyExecutor(ex.block_size, ex.num_blocks, poison=poison, named=named, transient=transient)
    engine.executor = faulty
    return engine, faulty


def _requests(n: int) -> list:
    return [req(f"r{i}", 5 + (3 * i) % 11, max_tokens=6 + i % 4) for i in range(n)]


def _reference(requests: list, without: set[str]) -> Collected:
    engine, _ = make_engine(num_blocks=96)
    for r in requests:
        if r.req_id not in without:
            engine.add_request(r)
    return run(engine)


def _serve(engine: EngineCore, requests: list) -> Collected:
    for r in requests:
        engine.add_request(r)
    return run(engine, driver=Overlapped(engine))


def _check(engine: EngineCore, ex: FaultyExecutor, got: Collected, requests: list, culprits: set[str]) -> None:
    want = _reference(requests, culprits)
    for (rid, index), reason in got.reasons.items():
        if rid in culprits:
            assert reason == "error", (rid, reason)
        else:
            assert reason == want.reasons[(rid, index)] and got.tokens[(rid, index)] == want.tokens[(rid, index)], rid
    assert {rid for rid, _ in got.reasons} == {r.req_id for r in requests}
    errors = [o.error for res in got.results for o in res.outputs if o.error is not None]
    assert errors and all(e.message.startswith("the request failed in the model's step") for e in errors)
    assert {o.req_id for res in got.results for o in res.outputs if o.error is not None} == culprits
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and not engine.groups and not engine.isolation.active
    sched = engine.scheduler  # what the worker holds, it is told to drop with the next step
    assert set(ex.reqs) <= sched._finished_ids | sched._preempted_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_named_culprit_fails_alone_and_the_others_get_their_tokens(async_scheduling: bool) -> None:
    engine, ex = _engine({"r3": 2}, named=True, async_scheduling=async_scheduling)
    requests = _requests(6)
    got = _serve(engine, requests)
    _check(engine, ex, got, requests, {"r3"})
    assert ex.num_failures == 1  # named: no search


@pytest.mark.parametrize(("n", "culprit", "after"), [(8, "r5", 3), (8, "r0", 0), (5, "r4", 1), (2, "r1", 4)])
def test_an_unnamed_culprit_is_found_by_the_search(n: int, culprit: str, after: int) -> None:
    engine, ex = _engine({culprit: after})
    requests = _requests(n)
    got = _serve(engine, requests)
    _check(engine, ex, got, requests, {culprit})
    assert ex.num_failures <= 2 * n.bit_length() + 2


def test_a_request_alone_in_its_failed_step_is_the_culprit_at_once() -> None:
    engine, ex = _engine({"r0": 1})
    requests = _requests(1)
    got = _serve(engine, requests)
    _check(engine, ex, got, requests, {"r0"})
    assert ex.num_failures == 1


def test_n_sequences_of_a_culprit_fail_together() -> None:
    engine, ex = _engine({"r2": 2})
    requests = [*_requests(4)[:2], req("r2", 7, max_tokens=5, n=3, temperature=1.0, seed=3), _requests(4)[3]]
    got = _serve(engine, requests)
    assert {got.reasons[("r2", i)] for i in range(3)} == {"error"}
    _check(engine, ex, got, requests, {"r2"})


def test_a_fault_that_does_not_come_back_fails_nobody() -> None:
    engine, ex = _engine({"r2": 2}, transient=1)
    requests = _requests(6)
    got = _serve(engine, requests)
    want = _reference(requests, set())
    assert got.tokens == want.tokens and got.reasons == want.reasons
    assert ex.num_failures == 1 and not engine.isolation.active and not engine.groups


def test_steps_that_keep_failing_reach_the_host() -> None:
    """A worker that fails every step is broken, not a request: after MAX_FAILED_STEPS_IN_A_ROW the error is
    raised (the SchedulerActor then rebuilds the workers)."""
    engine, ex = _engine({f"r{i}": 0 for i in range(40)})
    for r in [req(f"r{i}", 5, max_tokens=4) for i in range(40)]:
        engine.add_request(r)
    with pytest.raises(StepFailedError):
        for _ in range(200):
            engine.step_with_batch_queue()
    assert ex.num_failures == MAX_FAILED_STEPS_IN_A_ROW + 1


def _search(n: int, culprit: int | None, fresh: list[str] | None = None) -> tuple[list[str], int]:
    """The search over n requests with a deterministic culprit: steps of every request that may run, failing while
    the culprit runs. Returns (convicted, failed steps)."""
    iso, ids = FaultIsolation(), [f"q{i}" for i in range(n)]
    convicted = iso.on_failure(ids, fresh or [])
    failures = 1
    while iso.active:
        running = [r for r in ids if r not in iso.held]
        if culprit is not None and f"q{culprit}" in running:
            convicted = iso.on_failure(running, [])
            failures += 1
        else:
            iso.on_outputs([_out(r) for r in running], set(ids))
    return convicted, failures


def _out(req_id: str):  # noqa: ANN202
    from cbserve.scheduler import RequestOutput

    return RequestOutput(req_id, 0, [1], None)


@pytest.mark.parametrize("n", [2, 3, 8, 17, 64])
def test_the_search_convicts_exactly_the_culprit_within_its_budget(n: int) -> None:
    for culprit in {0, n // 2, n - 1}:
        convicted, failures = _search(n, culprit)
        assert convicted == [f"q{culprit}"] and failures <= 2 * n.bit_length() + 2


def test_the_first_probe_holds_the_fresh_requests() -> None:
    """The step's own split: the requests it did not admit or change run first; the fresh ones wait."""
    iso = FaultIsolation()
    assert iso.on_failure(["a", "b", "c", "d"], ["c"]) == []
    assert iso.held == {"c"} and iso.probe == ["a", "b", "d"]
    iso.on_outputs([_out("a"), _out("b"), _out("d")], {"a", "b", "c", "d"})
    assert iso.suspects == ["c"] and iso.probe == ["c"] and not iso.held  # the last suspect runs alone
    assert iso.on_failure(["c", "e"], ["c"]) == ["c"] and not iso.active


def test_a_transient_fault_clears_every_suspect() -> None:
    convicted, failures = _search(8, None)
    assert convicted == [] and failures == 1
