"""The multiplexed output channel (cluster/output_channel.py) without Ray, over its real socket: the engine end
batches items per request between messages, sends them to the reader holding the token and sees it go; the
ingress end hands each request its items in order, ignores requests nobody waits for, and fails every waiting
request when the connection breaks (the engine actor died). The engine's prefix-cache events ride on the same
frames: a snapshot first, then the changes, each frame's before its outputs; a broken channel resets them."""

from __future__ import annotations

import asyncio
from typing import Any

from channel_fakes import FakeChannelServer

from cbserve.cluster.engine_messages import EngineFailure, OpenChannel, OutputFrame
from cbserve.cluster.output_channel import ChannelBuffer, ChannelReader, ChannelServer
from cbserve.cluster.transport import TOKEN_BYTES, encode
from cbserve.scheduler.kv_events import KVCacheEvents
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
    assert first == OutputFrame({"a": [_out("a", 1), _out("a", 3)], "b": [_out("b", 2)]}, None)  # no cache events
    assert second == OutputFrame({"b": [_out("b", 4)]}, None) and pending


def _ignore(channel_id: str, message: Any) -> None:
    pass


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Engine:
    """The SchedulerActor's side of the channel: ``output_address`` serves ``server``'s address."""

    def __init__(self, server: Any) -> None:
        self.output_address = _Remote(server.address if isinstance(server, FakeChannelServer) else server.start)


def test_the_reader_routes_items_and_fails_the_waiting_when_the_stream_breaks() -> None:
    async def batches(channel_id: str, inbox: Any) -> Any:
        yield {"a": [_out("a", 1)], "gone": [_out("gone", 9)]}
        yield {"a": [_out("a", 2)]}  # then the connection closes: the engine actor died

    server = FakeChannelServer(batches)

    async def run() -> tuple[list[Any], list[Any], str, str]:
        reader = ChannelReader(_Engine(server), "ingress-1")
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
    assert server.opened[0] == first_id


def test_the_engine_end_sends_each_take_as_one_message_and_sees_its_reader_go() -> None:
    closed: list[str] = []

    async def run() -> tuple[list[Any], list[Any], str]:
        server = ChannelServer(_ignore, closed.append)
        reader = ChannelReader(_Engine(server), "ingress-1")
        qa, qb = reader.register("a"), reader.register("b")
        channel_id = reader.open()
        server.buffer(channel_id).put("a", _out("a", 1))  # before the reader connected: kept for it
        got_a = [await qa.get()]
        server.buffer(channel_id).put("b", _out("b", 2))
        server.buffer(channel_id).put("a", _out("a", 3))
        got_b = [await qb.get()]
        got_a.append(await qa.get())
        reader.close()  # the ingress goes away: the engine aborts its requests
        for _ in range(500):
            if closed:
                break
            await asyncio.sleep(0.01)
        server.close()
        return got_a, got_b, channel_id

    got_a, got_b, channel_id = asyncio.run(run())
    assert got_a == [[_out("a", 1)], [_out("a", 3)]] and got_b == [[_out("b", 2)]]
    assert closed == [channel_id]


def test_the_engine_end_refuses_a_peer_without_the_token() -> None:
    closed: list[str] = []

    async def run() -> tuple[bytes, list[Any]]:
        server = ChannelServer(_ignore, closed.append)
        address = await server.start()
        server.buffer("secret-channel").put("a", _out("a", 1))
        r, w = await asyncio.open_connection(address.host, address.port)
        w.write(b"x" * TOKEN_BYTES + encode(OpenChannel("secret-channel")))
        leaked = await asyncio.wait_for(r.read(), 10)  # closed without a byte of anyone's outputs
        w.close()
        reader = ChannelReader(_Engine(server), "ingress-1")
        queue = reader.register("a")
        got = []
        channel_id = reader.open()
        server.buffer(channel_id).put("a", _out("a", 2))
        got.append(await queue.get())
        reader.close()
        server.close()
        return leaked, got

    leaked, got = asyncio.run(run())
    assert leaked == b"" and got == [[_out("a", 2)]]
    assert "secret-channel" not in closed  # the refused peer never opened a channel


def test_prefix_cache_events_ride_on_the_frames() -> None:
    got: list[Any] = []

    async def run() -> None:
        server = ChannelServer(_ignore, lambda _: None, lambda: [1, 2])
        reader = ChannelReader(_Engine(server), "ingress-1", lambda ev: got.append(("events", ev)))
        queue = reader.register("a")
        channel_id = reader.open()
        server.buffer(channel_id)  # its requests' outputs are waited for: the buffer exists before it connects
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.01)
        server.put_cache_events(KVCacheEvents(stored=[3]))
        server.put_cache_events(KVCacheEvents(removed=[1]))  # both in the next frame, netted
        server.buffer(channel_id).put("a", _out("a", 1))
        got.append(("outputs", await queue.get()))
        reader.close()
        server.close()

    asyncio.run(run())
    assert got[0] == ("events", KVCacheEvents(stored=[1, 2], reset=True))  # the snapshot, first
    assert got[1] == ("events", KVCacheEvents(stored=[3], removed=[1]))  # then the changes, before the outputs
    assert got[2] == ("outputs", [_out("a", 1)])


def test_a_broken_channel_resets_the_replicas_cache_picture() -> None:
    async def batches(channel_id: str, inbox: Any) -> Any:
        yield OutputFrame({}, KVCacheEvents(stored=[5]))  # then the connection closes: the engine actor died

    server = FakeChannelServer(batches)
    got: list[KVCacheEvents] = []

    async def run() -> None:
        reader = ChannelReader(_Engine(server), "ingress-1", got.append)
        queue = reader.register("a")
        reader.open()
        await queue.get()  # the failure every waiting request gets
        reader.close()

    asyncio.run(run())
    assert got == [KVCacheEvents(stored=[5]), KVCacheEvents(reset=True)]
