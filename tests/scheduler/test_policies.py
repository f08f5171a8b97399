"""The comparison policies: prefill_first, static and dynamic batching."""

from __future__ import annotations

from sched_fakes import FakeClock, make_engine, req, run

from cbserve.scheduler.policies import BatchPolicy, ContinuousPolicy, PrefillFirstPolicy


def sched(so: object) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)  # type: ignore[attr-defined]


def test_policy_selection() -> None:
    assert isinstance(make_engine()[0].scheduler.policy, ContinuousPolicy)
    assert isinstance(make_engine(policy="prefill_first")[0].scheduler.policy, PrefillFirstPolicy)
    assert isinstance(make_engine(policy="static")[0].scheduler.policy, BatchPolicy)


def test_continuous_mixes_decode_and_prefill() -> None:
    engine, ex = make_engine()
    engine.add_request(req("a", 4, max_tokens=5))
    engine.step()
    engine.add_request(req("b", 6, max_tokens=5))
    engine.step()
    assert sched(ex.calls[1]) == {"a": 1, "b": 6}


def test_prefill_first_steps_are_prefill_only() -> None:
    engine, ex = make_engine(policy="prefill_first", max_batched=4)
    engine.add_request(req("a", 4, max_tokens=5))
    engine.step()
    engine.add_request(req("b", 6, max_tokens=5))
    engine.step()
    engine.step()
    assert sched(ex.calls[1]) == {"b": 4}  # a's decode waits
    assert sched(ex.calls[2]) == {"b": 2}  # b's prompt chunk continues, still no decode
    engine.step()
    assert sched(ex.calls[3]) == {"a": 1, "b": 1}  # no prefill work left: decode step
    col = run(engine)
    assert col.reasons == {("a", 0): "length", ("b", 0): "length"}
    for c in ex.calls:
        toks = sched(c)
        # a step never mixes a decode with a prefill chunk
        kinds = {n > 1 for n in toks.values()}
        assert len(kinds) == 1 or all(n == 1 for n in toks.values())


def test_static_batch_runs_until_longest_member_ends() -> None:
    engine, ex = make_engine(policy="static", max_seqs=2)
    engine.add_request(req("short", 3, max_tokens=2))
    engine.add_request(req("long", 3, max_tokens=6))
    engine.add_request(req("late", 3, max_tokens=2))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(set(sched(ex.calls[-1])))
        engine.check_integrity()
    # 'late' never joins while 'long' runs, even after 'short' left and a slot is free
    first_late = next(i for i, s in enumerate(steps) if "late" in s)
    last_long = max(i for i, s in enumerate(steps) if "long" in s)
    assert first_late == last_long + 1
    assert steps[0] == {"short", "long"} and steps[2] == {"long"}


def test_dynamic_batch_waits_for_size_or_window() -> None:
    clock = FakeClock(0.0)
    engine, ex = make_engine(
        policy="dynamic", max_seqs=8, clock=clock, dynamic_batch_size=3, dynamic_batch_window_s=1.0
    )
    engine.add_request(req("a", 3, max_tokens=2))
    engine.add_request(req("b", 3, max_tokens=2))
    assert engine.step().scheduler_stats.batch_size == 0 and not ex.calls  # 2 < 3 and window not over
    clock.advance(0.5)
    engine.step()
    assert not ex.calls
    engine.add_request(req("c", 3, max_tokens=2))  # size reached
    engine.step()
    assert set(sched(ex.calls[0])) == {"a", "b", "c"}
    run(engine)
    engine.add_request(req("d", 3, max_tokens=2))
    clock.advance(0.9)
    engine.step()
    n_calls = len(ex.calls)
    clock.advance(0.2)  # the oldest has now waited 1.1 s
    engine.step()
    assert len(ex.calls) == n_calls + 1 and set(sched(ex.calls[-1])) == {"d"}
    run(engine)


def test_static_with_preemption_readmits_members() -> None:
    engine, ex = make_engine(policy="static", num_blocks=6, block_size=4, max_seqs=3)
    for i in range(3):
        engine.add_request(req(f"r{i}", 6, max_tokens=10))
    engine.add_request(req("late", 3, max_tokens=2))
    col = run(engine)
    assert len(col.reasons) == 4
    assert any(c.preempted_req_ids for c in ex.calls)
    steps = [set(sched(c)) for c in ex.calls]
    first_late = next(i for i, s in enumerate(steps) if "late" in s)
    assert all(not (s & {"r0", "r1", "r2"}) for s in steps[first_late:])


# ---- the strategy questions, asked directly ---------------------------------------------------------
def ask(engine: object) -> frozenset[str] | None:
    sched_ = engine.scheduler  # type: ignore[attr-defined]
    return sched_.policy.may_run(sched_.waiting, sched_.seqs)


def test_continuous_and_prefill_first_answers() -> None:
    for policy, prefill_first in (("continuous", False), ("prefill_first", True)):
        engine, _ = make_engine(policy=policy)
        engine.add_request(req("a", 4))
        assert engine.scheduler.policy.prefill_first is prefill_first
        assert ask(engine) is None  # any request may run


def test_static_batch_membership_answers() -> None:
    engine, _ = make_engine(policy="static", max_seqs=2)
    assert ask(engine) == frozenset()  # nothing waits: no batch
    for name in ("a", "b", "c"):
        engine.add_request(req(name, 3, max_tokens=2 if name == "a" else 4))
    assert ask(engine) == {"a", "b"}  # the first max_num_seqs waiting requests
    assert engine.scheduler.policy.prefill_first is False
    while "a" in engine.groups:
        engine.step()
    assert ask(engine) == {"b"}  # a left; c does not join
    while "b" in engine.groups:
        engine.step()
    assert ask(engine) == {"c"}  # the next batch


def test_dynamic_formation_answers() -> None:
    clock = FakeClock(0.0)
    engine, _ = make_engine(policy="dynamic", clock=clock, dynamic_batch_size=2, dynamic_batch_window_s=1.0)
    engine.add_request(req("a", 3))
    assert ask(engine) == frozenset()  # 1 < 2 waiting, window open
    clock.advance(1.0)
    assert ask(engine) == {"a"}  # the oldest waited the whole window
    engine2, _ = make_engine(policy="dynamic", clock=FakeClock(0.0), dynamic_batch_size=2)
    engine2.add_request(req("a", 3))
    engine2.add_request(req("b", 3))
    assert ask(engine2) == {"a", "b"}  # size reached


class OnlyB:
    """A stand-in strategy: the scheduler must follow its answers."""

    prefill_first = False

    def __init__(self) -> None:
        self.asked = 0

    def may_run(self, waiting: object, unfinished: object) -> frozenset[str] | None:
        self.asked += 1
        return frozenset({"b"})


def test_scheduler_follows_the_policy_answers() -> None:
    engine, ex = make_engine()
    policy = engine.scheduler.policy = OnlyB()  # type: ignore[assignment]
    engine.add_request(req("a", 4, max_tokens=2))
    engine.add_request(req("b", 4, max_tokens=2))
    engine.step()
    engine.step()
    assert [set(sched(c)) for c in ex.calls] == [{"b"}, {"b"}]
    assert policy.asked == 2 and "a" in engine.groups and "b" not in engine.groups
