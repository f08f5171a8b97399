"""The scheduler's and the engine's invariants, checked by tests after every operation (``Scheduler.check_integrity``,
``EngineCore.check_integrity``)."""

from __future__ import annotations

from typing import Any

from cbserve.scheduler.requests.request import RequestStatus

_RUNNING = RequestStatus.RUNNING
_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def check_scheduler(sched: Any) -> None:
    """Every invariant of a ``Scheduler`` (typed Any: this module must not import it back)."""
    sched.kv.check_integrity()
    keys = [s.sort_key for s in sched.running]
    assert keys == sorted(keys), "running list is not sorted"
    running_ids = {s.seq_id for s in sched.running}
    waiting_ids = {s.seq_id for s in sched.waiting.ordered()}
    assert len(running_ids) == len(sched.running) and len(waiting_ids) == len(sched.waiting)
    assert not running_ids & waiting_ids, "a sequence is both running and waiting"
    assert running_ids | waiting_ids == set(sched.seqs), "running + waiting != unfinished sequences"
    assert running_ids == set(sched.kv.tables), "only running sequences hold blocks"
    for seq in sched.running:
        assert seq.status is _RUNNING, f"{seq} in running"
        assert seq.num_computed_tokens <= seq.num_tokens + seq.num_pending
        assert seq.num_pending == 0 or sched.config.async_scheduling, f"{seq} runs ahead in sync mode"
        need = sched.kv.num_required_blocks(seq.num_computed_tokens)
        assert len(sched.kv.tables[seq.seq_id]) >= need, f"{seq} lacks blocks for its computed tokens"
    preempted = [s for s in sched.waiting.ordered() if s.status is RequestStatus.PREEMPTED]
    assert len(preempted) == sched.num_preempted_waiting, "preempted-waiting counter is off"
    beams = {s.seq_id for s in preempted if s.group.mode == "beam"}
    assert set(sched._preempted_beams) == beams, "preempted beams are off"
    for seq in sched.waiting.ordered():
        assert seq.status in _WAITING_STATES and seq.num_computed_tokens == 0, f"{seq} in waiting"


def check_engine(engine: Any) -> None:
    """Every invariant of an ``EngineCore`` (typed Any: this module must not import it back)."""
    engine.scheduler.check_integrity()
    seqs = engine.scheduler.seqs
    for seq_id, seq in seqs.items():
        assert engine.groups.get(seq.group.req_id) is seq.group, f"{seq_id} belongs to no live request"
    for group in engine.groups.values():
        unfinished = [s for s in group.seqs if not s.is_finished]
        assert len(unfinished) == group.num_unfinished > 0, f"{group.req_id}: unfinished count is off"
        for seq in unfinished:
            assert seqs.get(seq.seq_id) is seq, f"{seq} is unfinished but unknown to the scheduler"
