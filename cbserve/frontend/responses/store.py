"""The Responses API's store: responses created with ``store: true``, for ``GET`` / ``DELETE /v1/responses/{id}``
and for chaining with ``previous_response_id``.

``ResponsesAPI`` reaches its store through ``StoredResponses`` (async ``get`` / ``put`` / ``delete``). Served, that is
the app's store, one for every ingress replica (``cluster/stores/response_store.py``: a Ray actor holding a
``ResponseStore``), so a response stored through one replica is read through any other; ``InMemoryResponses`` keeps
one in this process (unit tests, one process).

``ResponseStore`` is the bookkeeping both use: at most ``max_entries`` entries (the least recently used out first)
and none older than ``ttl_s`` seconds (counted from when it was stored; an expired entry is gone, as if never
stored). The bound counts entries, not bytes: an entry holds its whole conversation (every input item of its chain
and its output), so a long chain's entries are large; size ``max_entries`` for the longest conversations served.
Nothing is kept across a restart of the store."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cbserve.frontend.responses.protocol import InputItem, ResponseObject

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """A response and the conversation it ends: every input item of its chain (its own and its predecessors',
    ``instructions`` left out as OpenAI does) followed by its output as input items."""

    response: ResponseObject
    items: tuple[InputItem, ...]


class StoredResponses(Protocol):
    """Where ``ResponsesAPI`` keeps responses: ``get`` (None: unknown, deleted or expired), ``put``, ``delete``
    (False: there was none)."""

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, entry: StoredResponse) -> None: ...

    async def delete(self, response_id: str) -> bool: ...


class ResponseStore:
    """Entries by response id, bounded by count (least recently used out first) and by age (``ttl_s`` from when an
    entry was stored); ``clock`` gives the time in seconds (monotonic by default; tests inject their own)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._stored_at: OrderedDict[str, float] = OrderedDict()  # oldest first: the order they expire in
        self.max_entries, self.ttl_s = DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S
        self.configure(max_entries, ttl_s)

    def configure(self, max_entries: int, ttl_s: float) -> None:
        """New bounds (the app's configuration); entries beyond them go at once."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._evict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        key = entry.response.id
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._stored_at[key] = self.clock()
        self._stored_at.move_to_end(key)
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        self._expire()
        self._stored_at.pop(response_id, None)
        return self._entries.pop(response_id, None) is not None

    def _evict(self) -> None:
        self._expire()
        while len(self._entries) > self.max_entries:
            key, _ = self._entries.popitem(last=False)
            del self._stored_at[key]

    def _expire(self) -> None:
        """The entries stored ``ttl_s`` or longer ago go (the oldest first: the ttl is the same for all)."""
        oldest = self.clock() - self.ttl_s
        while self._stored_at:
            key, at = next(iter(self._stored_at.items()))
            if at > oldest:
                break
            del self._stored_at[key], self._entries[key]


class InMemoryResponses:
    """``StoredResponses`` in this process: one ``ResponseStore`` (unit tests; a served app shares one store among
    its ingress replicas instead)."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    def __len__(self) -> int:
        return len(self.store)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def put(self, entry: StoredResponse) -> None:
        self.store.put(entry)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
