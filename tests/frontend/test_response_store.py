"""The Responses API's store (``frontend/responses/store.py``): bounded by count with the least recently used out
first, entries gone once older than the expiry (an injected clock), new bounds applied at once; and the
in-process ``StoredResponses`` that ``ResponsesAPI`` uses without Ray. The app-wide store (a Ray actor around the
same ``ResponseStore``) is checked end to end in tests/e2e/test_response_store_shared.py."""

from __future__ import annotations

import asyncio

import pytest

from cbserve.frontend.responses.protocol import ResponseObject
from cbserve.frontend.responses.store import InMemoryResponses, ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _entry(i: int) -> StoredResponse:
    return StoredResponse(ResponseObject(id=f"resp_{i}", model="m"), ())


def test_store_is_bounded_least_recently_used_first() -> None:
    store = ResponseStore(max_entries=2)
    entries = [_entry(i) for i in range(3)]
    store.put(entries[0])
    store.put(entries[1])
    assert store.get("resp_0") is entries[0]  # now the most recently used
    store.put(entries[2])
    assert len(store) == 2 and store.get("resp_1") is None and store.get("resp_0") is entries[0]
    assert store.get("resp_2") is entries[2]
    with pytest.raises(ValueError):
        ResponseStore(0)
    with pytest.raises(ValueError):
        ResponseStore(2, ttl_s=0)


def test_an_entry_older_than_the_ttl_is_gone_however_recently_read() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=60.0, clock=clock)
    store.put(_entry(0))
    clock.now += 30
    store.put(_entry(1))
    clock.now += 29.9
    assert store.get("resp_0") is not None  # read (most recently used), yet stored 59.9 s ago
    clock.now += 0.1
    assert store.get("resp_0") is None and store.get("resp_1") is not None  # 60 s old: gone, as if never stored
    assert not store.delete("resp_0") and len(store) == 1
    clock.now += 30
    assert len(store) == 0 and store.get("resp_1") is None


def test_storing_again_renews_an_entry() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=2, ttl_s=60.0, clock=clock)
    store.put(_entry(0))
    store.put(_entry(1))
    clock.now += 50
    store.put(_entry(0))  # stored again: younger, and the most recently used
    store.put(_entry(2))  # over the bound: resp_1 (least recently used) goes
    assert store.get("resp_1") is None
    clock.now += 50  # resp_0 stored 50 s ago, resp_2 too
    assert store.get("resp_0") is not None and store.get("resp_2") is not None


def test_new_bounds_apply_at_once() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=4, ttl_s=100.0, clock=clock)
    for i in range(4):
        store.put(_entry(i))
        clock.now += 10
    store.get("resp_0")
    store.configure(2, 100.0)  # the two least recently used go
    assert [store.get(f"resp_{i}") is not None for i in range(4)] == [True, False, False, True]
    store.configure(2, 25.0)  # resp_0 was stored 40 s ago, resp_3 10 s ago
    assert store.get("resp_0") is None and store.get("resp_3") is not None and len(store) == 1


def test_in_memory_responses_is_the_async_interface_over_one_store() -> None:
    responses = InMemoryResponses(ResponseStore(max_entries=1))

    async def run() -> tuple[object, object, bool, bool, int]:
        await responses.put(_entry(0))
        await responses.put(_entry(1))
        return (await responses.get("resp_0"), await responses.get("resp_1"), await responses.delete("resp_1"),
                await responses.delete("resp_1"), len(responses))  # fmt: skip

    gone, kept, deleted, again, size = asyncio.run(run())
    assert gone is None and isinstance(kept, StoredResponse) and deleted and not again and size == 0
