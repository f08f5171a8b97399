"""Waiting queues: FCFS (a deque; preempted sequences go back to the front) and priority (a heap ordered
by (priority, arrival order), so a preempted sequence regains its place)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from cbserve.scheduler.requests.sequence import Sequence


class WaitingQueue(Protocol):
    def add(self, seq: Sequence) -> None: ...
    def add_front(self, seq: Sequence) -> None: ...
    def peek(self) -> Sequence | None: ...  # the first (None: empty)
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def ordered(self) -> Iterator[Sequence]: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
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

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Sequence]] = []

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._heap, (seq.sort_key, seq))

    add_front = add  # its key keeps its place: ahead of later arrivals of the same priority

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


def make_waiting_queue(ordering: str) -> WaitingQueue:
    if ordering == "priority":
        return PriorityQueue()
    if ordering == "fcfs":
        return FCFSQueue()
    raise ValueError(f"unknown ordering {ordering!r}")
