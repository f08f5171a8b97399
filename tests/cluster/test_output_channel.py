"""The multiplexed output channel (cluster/output_channel.py) without Ray: the engine end batches items per
request between messages; the ingress end hands each request its items in order, ignores requests nobody
waits for, and fails every waiting request when the stream breaks (the engine actor died)."""

from __future__ import annotations

import asyncio
from typing import Any

from cbserve.cluster.output_channel import ChannelBuffer, ChannelReader, EngineFailure
from cbserve.scheduler.request import RequestOutput


def _out(req_id: str, token: int) -> RequestOutput:
    return RequestOutput(req_id, 0, [token], None)


def test_the_buffer_batches_per_request_until_taken() -> None:
    async def run() -> tuple[Any, Any, bool]:
        buf = ChannelBuffer()
        buf.put("a", _out("a", 1))
        buf.put("b", _out("b", 2))
        buf.put("a", _out("a", 3))
        first = await buf.take()
        waiter = asyncio.ensure_future(buf.take())
        await asyncio.sleep(0.01)
        pending = not waiter.done()  # nothing new: take waits
        buf.put("b", _out("b", 4))
        return first, await waiter, pending

    first, second, pending = asyncio.run(run())
    assert first == {"a": [_out("a", 1), _out("a", 3)], "b": [_out("b", 2)]}
    assert second == {"b": [_out("b", 4)]} and pending


class _Engine:
    """Streams ``batches`` on the channel, then breaks (``error``) or stays open."""

    def __init__(self, batches: list[dict[str, Any]], error: Exception | None) -> None:
        self.batches, self.error, self.opened = batches, error, []
        self.output_channel = _remote(self._stream)

    async def _stream(self, channel_id: str) -> Any:
        self.opened.append(channel_id)
        for batch in self.batches:
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(batch)
            yield fut
        if self.error is not None:
            raise self.error
        await asyncio.Event().wait()


def _remote(fn: Any) -> Any:
    class _R:
        remote = staticmethod(fn)

    return _R()


def test_the_reader_routes_items_and_fails_the_waiting_when_the_stream_breaks() -> None:
    engine = _Engine([{"a": [_out("a", 1)], "gone": [_out("gone", 9)]}, {"a": [_out("a", 2)]}], RuntimeError("x"))

    async def run() -> tuple[list[Any], list[Any], str, str]:
        reader = ChannelReader(engine, "ingress-1")
        qa, qb = reader.register("a"), reader.register("b")
        first_id = reader.open()
        got_a = [await qa.get(), await qa.get(), await qa.get()]
        got_b = [await qb.get()]
        second_id = reader.open()  # the broken channel is replaced by a fresh one
        reader.close()
        return got_a, got_b, first_id, second_id

    got_a, got_b, first_id, second_id = asyncio.run(run())
    assert got_a[:2] == [[_out("a", 1)], [_out("a", 2)]]
    for items in (got_a[2], got_b[0]):
        assert len(items) == 1 and isinstance(items[0], EngineFailure) and items[0].kind == "unavailable"
    assert first_id.startswith("ingress-1:") and second_id != first_id
    assert engine.opened[0] == first_id
