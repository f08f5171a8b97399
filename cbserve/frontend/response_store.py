"""The Responses API's store: responses created with ``store: true``, kept in memory by one ingress replica
(bounded, least recently used out first) for ``GET`` / ``DELETE /v1/responses/{id}`` and for chaining with
``previous_response_id``. Nothing is shared between replicas or kept across restarts: a chained request must
reach the replica that stored its predecessor (one replica, or a client that sticks to it)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .protocol_responses import InputItem, ResponseObject

DEFAULT_MAX_ENTRIES = 1024


@dataclass(frozen=True)
class StoredResponse:
    """A response and the conversation it ends: every input item of its chain (its own and its predecessors',
    ``instructions`` left out as OpenAI does) followed by its output as input items."""

    response: ResponseObject
    items: tuple[InputItem, ...]


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        key = entry.response.id
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
