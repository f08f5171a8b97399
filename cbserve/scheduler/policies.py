"""Scheduling policies, selected by ``SchedulerConfig.policy``: strategies the scheduler asks two small
questions every step, never callers back into it.

- ``prefill_first``: does prefill work (running prefill chunks, then admissions) go before decodes, with
  decodes run only in a step that found no prefill work?
- ``may_run(waiting, unfinished)``: the request ids that may be scheduled this step (running or admitted),
  or None for any. An empty set schedules nothing.

The scheduler (scheduler.py) owns the one rule that uses the answers. The policies:

- ``continuous`` (default): running sequences first (decode or next prefill chunk), then admit waiting.
- ``prefill_first``: a step is prefill-only while any prefill work can be scheduled, decodes otherwise.
- ``static``: form a batch of up to ``max_num_seqs`` waiting requests and run it until its longest
  member ends (finished members leave, no one joins), then form the next.
- ``dynamic``: like static, but a batch only starts once ``dynamic_batch_size`` requests wait or the
  oldest has waited ``dynamic_batch_window_s`` (by the injected clock).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from cbserve.scheduler.config import SchedulerConfig
from cbserve.scheduler.requests.sequence import Sequence
from cbserve.scheduler.waiting_queue import WaitingQueue


class SchedulingPolicy(Protocol):
    prefill_first: bool

    def may_run(self, waiting: WaitingQueue, unfinished: Mapping[str, Sequence]) -> frozenset[str] | None:
        """Request ids that may be scheduled this step (None: any). ``unfinished``: every unfinished
        sequence by sequence id."""
        ...


class ContinuousPolicy:
    prefill_first = False

    def may_run(self, waiting: WaitingQueue, unfinished: Mapping[str, Sequence]) -> frozenset[str] | None:
        return None


class PrefillFirstPolicy:
    prefill_first = True

    def may_run(self, waiting: WaitingQueue, unfinished: Mapping[str, Sequence]) -> frozenset[str] | None:
        return None


class BatchFormation(Protocol):
    """Decides when a new static batch may start."""

    def ready(self, waiting: WaitingQueue) -> bool: ...


class Immediately:
    def ready(self, waiting: WaitingQueue) -> bool:
        return bool(waiting)


class SizeOrWindow:
    def __init__(self, size: int, window_s: float, clock: Callable[[], float]) -> None:
        self.size = size
        self.window_s = window_s
        self.clock = clock

    def ready(self, waiting: WaitingQueue) -> bool:
        if not waiting:
            return False
        if len(waiting) >= self.size:
            return True
        oldest = min(seq.group.enqueue_time for seq in waiting.ordered())
        return self.clock() - oldest >= self.window_s


class BatchPolicy:
    """Static batching; the formation rule decides when a batch starts (static or dynamic)."""

    prefill_first = False

    def __init__(self, max_batch: int, formation: BatchFormation) -> None:
        self.max_batch = max_batch
        self.formation = formation
        self.members: set[str] = set()  # request ids of the current batch

    def may_run(self, waiting: WaitingQueue, unfinished: Mapping[str, Sequence]) -> frozenset[str] | None:
        if self.members:
            self.members &= {seq.group.req_id for seq in unfinished.values()}
        if not self.members and self.formation.ready(waiting):
            for seq in waiting.ordered():
                if len(self.members) >= self.max_batch:
                    break
                self.members.add(seq.group.req_id)
        return frozenset(self.members)


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


PAUSE_MODES = ("keep", "abort", "wait")


def paused_may_run(mode: str, allowed: frozenset[str] | None, unfinished: Mapping[str, Sequence]) -> frozenset[str]:
    """What a paused engine may schedule (``Scheduler.pause_mode``): "keep" nothing (its requests keep their KV and
    go on at resume); "wait" the requests already started (running, or preempted to be recomputed) and no other."""
    if mode != "wait":
        return frozenset()
    started = frozenset(s.group.req_id for s in unfinished.values() if s.group.times.first_scheduled is not None)
    return started if allowed is None else started & allowed
