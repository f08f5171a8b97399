"""Waiting queues: FCFS (a deque; preempted sequences go back to the front) and priority (a heap ordered
by (priority, arrival order), so a preempted sequence regains its place). A queue holds at most ``capacity``
new requests' sequences: ``add`` refuses one more (QueueFullError); a preempted sequence always goes back."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from cbserve.scheduler.errors import QueueFullError
from cbserve.scheduler.requests.sequence import Sequence


class WaitingQueue(Protocol):
    def add(self, seq: Sequence) -> None: ...  # a new request's: QueueFullError when the queue is full
    def add_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...  # the first (None: empty)
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def ordered(self) -> Iterator[Sequence]: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...


def _full(capacity: int) -> QueueFullError:
    return QueueFullError(f"the waiting queue is full ({capacity} requests); retry later")


class FCFSQueue:
    def __init__(self, capacity: int) -> None:
        self._q: deque[Sequence] = deque()
        self.capacity = capacity

    def add(self, seq: Sequence) -> None:
        if len(self._q) >= self.capacity:
            raise _full(self.capacity)
        self._q.append(seq)

    def add_front(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._q[0] if self._q else None

    def pop(self) -> Sequence:
        return self._q.popleft()

    def remove(self, seq: Sequence) -> None:
        if self._q and self._q[0] is seq:
            self._q.popleft()
        else:
            self._q.remove(seq)

    def ordered(self) -> Iterator[Sequence]:
        return iter(list(self._q))

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)


class PriorityQueue:
    """Lower ``sort_key`` first: (priority, arrival counter, sequence index)."""

    def __init__(self, capacity: int) -> None:
        self._heap: list[tuple[tuple, Sequence]] = []
        self.capacity = capacity

    def add(self, seq: Sequence) -> None:
        if len(self._heap) >= self.capacity:
            raise _full(self.capacity)
        heapq.heappush(self._heap, (seq.sort_key, seq))

    def add_front(self, seq: Sequence) -> None:  # its key keeps its place: ahead of later arrivals of its priority
        heapq.heappush(self._heap, (seq.sort_key, seq))

    def peek(self) -> Sequence | None:
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        if self._heap and self._heap[0][1] is seq:
            heapq.heappop(self._heap)
            return
        self._heap = [item for item in self._heap if item[1] is not seq]
        heapq.heapify(self._heap)

    def ordered(self) -> Iterator[Sequence]:
        return (item[1] for item in sorted(self._heap, key=lambda item: item[0]))

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


def make_waiting_queue(ordering: str, capacity: int) -> WaitingQueue:
    if ordering == "priority":
        return PriorityQueue(capacity)
    if ordering == "fcfs":
        return FCFSQueue(capacity)
    raise ValueError(f"unknown ordering {ordering!r}")
