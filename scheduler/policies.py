"""Scheduling policies, selected by ``SchedulerConfig.policy``. Each composes the scheduler's two
primitives, ``schedule_running(st, select)`` and ``admit_waiting(st, accept)``:

- ``continuous`` (default): running sequences first (decode or next prefill chunk), then admit waiting.
- ``prefill_first``: prefill work (running prefill chunks, then admissions) first; a step is
  prefill-only while any prefill work can be scheduled, and decodes only otherwise.
- ``static``: form a batch of up to ``max_num_seqs`` waiting requests and run it until its longest
  member ends (finished members leave, no one joins), then form the next.
- ``dynamic``: like static, but a batch only starts once ``dynamic_batch_size`` requests wait or the
  oldest has waited ``dynamic_batch_window_s`` (by the injected clock).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .config import SchedulerConfig

if TYPE_CHECKING:
    from .scheduler import Scheduler, StepState
    from .sequence import Sequence


class SchedulingPolicy(Protocol):
    def schedule(self, scheduler: Scheduler, st: StepState) -> None: ...


class ContinuousPolicy:
    def schedule(self, scheduler: Scheduler, st: StepState) -> None:
        scheduler.schedule_running(st)
        scheduler.admit_waiting(st)


def _is_prefill(seq: Sequence) -> bool:
    return seq.is_prefill


class PrefillFirstPolicy:
    def schedule(self, scheduler: Scheduler, st: StepState) -> None:
        scheduler.schedule_running(st, select=_is_prefill)
        scheduler.admit_waiting(st)
        if not st.scheduled:
            scheduler.schedule_running(st)


class BatchFormation(Protocol):
    """Decides when a new static batch may start."""

    def ready(self, scheduler: Scheduler) -> bool: ...


class Immediately:
    def ready(self, scheduler: Scheduler) -> bool:
        return bool(scheduler.waiting)


class SizeOrWindow:
    def __init__(self, size: int, window_s: float, clock: Callable[[], float]) -> None:
        self.size = size
        self.window_s = window_s
        self.clock = clock

    def ready(self, scheduler: Scheduler) -> bool:
        waiting = scheduler.waiting
        if not waiting:
            return False
        if len(waiting) >= self.size:
            return True
        oldest = min(seq.group.enqueue_time for seq in waiting.ordered())
        return self.clock() - oldest >= self.window_s


class BatchPolicy:
    """Static batching; the formation rule decides when a batch starts (static or dynamic)."""

    def __init__(self, max_batch: int, formation: BatchFormation) -> None:
        self.max_batch = max_batch
        self.formation = formation
        self.members: set[str] = set()  # group req ids of the current batch

    def schedule(self, scheduler: Scheduler, st: StepState) -> None:
        if self.members:
            active = {seq.group.req_id for seq in scheduler.seqs.values()}
            self.members &= active
        if not self.members and self.formation.ready(scheduler):
            self._form_batch(scheduler)
        if not self.members:
            return
        members = self.members
        accept = lambda seq: seq.group.req_id in members
        scheduler.schedule_running(st, select=accept)
        scheduler.admit_waiting(st, accept=accept)

    def _form_batch(self, scheduler: Scheduler) -> None:
        for seq in scheduler.waiting.ordered():
            if len(self.members) >= self.max_batch:
                break
            self.members.add(seq.group.req_id)


def make_policy(config: SchedulerConfig, clock: Callable[[], float]) -> SchedulingPolicy:
    if config.policy == "continuous":
        return ContinuousPolicy()
    if config.policy == "prefill_first":
        return PrefillFirstPolicy()
    if config.policy == "static":
        return BatchPolicy(config.max_num_seqs, Immediately())
    if config.policy == "dynamic":
        formation = SizeOrWindow(config.dynamic_batch_size, config.dynamic_batch_window_s, clock)
        return BatchPolicy(config.max_num_seqs, formation)
    raise ValueError(f"unknown scheduling policy {config.policy!r}")
