"""The channel between an ingress and an engine replica without Ray, over its real socket: the engine end
(cluster/channel/server.py) batches items per request between frames, numbers its channels (each request's outputs
go back on the channel it came on), sends the replica's state and a prefix-cache snapshot first and the changes
after, refuses a peer without the token and sees its reader go; the ingress end (cluster/channel/reader.py) hands
every frame to its sink in order, writes only while connected, and tells the sink at once when the connection
breaks, then connects again."""

from __future__ import annotations

import asyncio
from typing import Any

from channel_fakes import FakeChannelServer

from cbserve.cluster.channel.messages import AbortRequest, EngineState, OpenChannel, OutputFrame
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.channel.server import ChannelBuffer, ChannelServer
from cbserve.cluster.channel.transport import TOKEN_BYTES, encode
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.requests.request import RequestOutput

READY = EngineState("ready", 1)


def _out(req_id: str, token: int) -> RequestOutput:
    return RequestOutput(req_id, 0, [token], None)


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Engine:
    """The SchedulerActor's side of the channel: ``output_address`` serves ``server``'s address."""

    def __init__(self, server: Any) -> None:
        self.output_address = _Remote(server.address if isinstance(server, FakeChannelServer) else server.start)


class _Sink:
    def __init__(self) -> None:
        self.frames: list[OutputFrame] = []
        self.breaks: list[str] = []
        self.event = asyncio.Event()

    def frame(self, replica: int, frame: OutputFrame) -> None:
        self.frames.append(frame)
        self.event.set()

    def broken(self, replica: int, why: str) -> None:
        self.breaks.append(why)
        self.event.set()

    async def until(self, cond: Any) -> None:
        for _ in range(500):
            if cond():
                return
            self.event.clear()
            await asyncio.wait([asyncio.ensure_future(self.event.wait())], timeout=0.02)
        raise TimeoutError("the sink never saw it")


def test_the_buffer_batches_per_request_until_taken() -> None:
    async def run() -> tuple[Any, Any, bool]:
        buf = ChannelBuffer()
        buf.put("a", _out("a", 1))
        buf.put("b", _out("b", 2))
        buf.put("a", _out("a", 3))
        buf.put_state(READY)
        first = await buf.take()
        waiter = asyncio.ensure_future(buf.take())
        await asyncio.sleep(0.01)
        pending = not waiter.done()  # nothing new: take waits
        buf.put("b", _out("b", 4))
        return first, await waiter, pending

    first, second, pending = asyncio.run(run())
    assert first == OutputFrame({"a": [_out("a", 1), _out("a", 3)], "b": [_out("b", 2)]}, None, READY)
    assert second == OutputFrame({"b": [_out("b", 4)]}) and pending  # no cache events, the state unchanged


def test_frames_reach_the_sink_in_order_with_the_state_and_cache_first() -> None:
    messages: list[tuple[int, Any]] = []
    closed: list[int] = []

    async def run() -> tuple[_Sink, bool, bool]:
        server = ChannelServer(lambda client, msg: messages.append((client, msg)), closed.append,
                               lambda: (READY, KVCacheEvents(stored=[1, 2], reset=True)))  # fmt: skip
        sink = _Sink()
        reader = ChannelReader(_Engine(server), 0, "ingress-1", sink)
        before = reader.send(AbortRequest("early"))  # not connected yet: nothing written
        reader.start()
        await sink.until(lambda: sink.frames)
        client = next(iter(server.buffers))
        sent = reader.send(AbortRequest("a"))
        server.put_cache_events(KVCacheEvents(stored=[3]))
        server.put_cache_events(KVCacheEvents(removed=[1]))  # both in the next frame, netted
        server.put(client, "a", _out("a", 1))
        server.put(client + 7, "a", _out("a", 9))  # a channel that is not there: dropped
        await sink.until(lambda: len(sink.frames) >= 2 and messages)
        reader.close()  # the ingress goes away: the engine sees its channel end
        for _ in range(500):
            if closed:
                break
            await asyncio.sleep(0.01)
        server.close()
        return sink, before, sent

    sink, before, sent = asyncio.run(run())
    first, second = sink.frames[:2]
    assert first == OutputFrame({}, KVCacheEvents(stored=[1, 2], reset=True), READY)  # the snapshot, first
    assert second == OutputFrame({"a": [_out("a", 1)]}, KVCacheEvents(stored=[3], removed=[1]))
    assert not before and sent and messages == [(1, AbortRequest("a"))] and closed == [1] and not sink.breaks


def test_the_engine_end_refuses_a_peer_without_the_token() -> None:
    closed: list[int] = []

    async def run() -> tuple[bytes, _Sink]:
        server = ChannelServer(lambda *_: None, closed.append, lambda: (READY, None))
        address = await server.start()
        r, w = await asyncio.open_connection(address.host, address.port)
        w.write(b"x" * TOKEN_BYTES + encode(OpenChannel("secret-channel")))
        leaked = await asyncio.wait_for(r.read(), 10)  # closed without a byte of anyone's outputs
        w.close()
        sink = _Sink()
        reader = ChannelReader(_Engine(server), 0, "ingress-1", sink)
        reader.start()
        await sink.until(lambda: sink.frames)
        reader.close()
        for _ in range(500):
            if closed:
                break
            await asyncio.sleep(0.01)
        server.close()
        return leaked, sink

    leaked, sink = asyncio.run(run())
    assert leaked == b"" and sink.frames[0].state == READY
    assert closed == [1]  # the refused peer never got a channel: the reader's is the first


def test_a_broken_channel_is_told_at_once_and_connected_again() -> None:
    async def frames(channel_id: str, inbox: Any) -> Any:
        yield OutputFrame({"a": [_out("a", 1)]}, KVCacheEvents(stored=[5]), READY)  # then it closes: the actor died

    server = FakeChannelServer(frames)

    async def run() -> tuple[_Sink, list[str]]:
        sink = _Sink()
        reader = ChannelReader(_Engine(server), 0, "ingress-1", sink)
        reader.start()
        await sink.until(lambda: len(sink.breaks) >= 2)  # broken, connected again, broken again
        reader.close()
        await server.close()
        return sink, server.opened

    sink, opened = asyncio.run(run())
    assert sink.frames[0] == OutputFrame({"a": [_out("a", 1)]}, KVCacheEvents(stored=[5]), READY)
    assert "closed the channel" in sink.breaks[0]
    assert len(opened) >= 2 and opened[0] != opened[1] and all(c.startswith("ingress-1:") for c in opened)
