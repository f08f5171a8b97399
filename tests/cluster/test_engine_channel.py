"""The two-way engine channel without Ray: typed messages (cluster/engine_messages.py) round trip through the
framing (cluster/transport.py); the real ChannelServer and ChannelReader with the SchedulerActor's own message
handling over a fake EngineCore: an AddRequest is answered on the channel (``Admitted`` before any output, or
the request's EngineFailure), aborts and stop-string finishes reach the engine, and a peer that sends anything
but its channel id first is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cbserve.cluster.engine_messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    Admitted,
    EngineFailure,
    FinishSequence,
    OpenChannel,
    OutputFrame,
)
from cbserve.cluster.output_channel import ChannelReader, ChannelServer
from cbserve.cluster.scheduler_actor import SchedulerActor
from cbserve.cluster.transport import encode, read_message
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import QueueFullError
from cbserve.scheduler.kv_events import KVCacheEvents
from cbserve.scheduler.request import EngineRequest, RequestOutput
from cbserve.scheduler.sampling_params import SamplingParams


def _request(req_id: str) -> EngineRequest:
    return EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))


def test_typed_messages_round_trip_through_the_framing() -> None:
    messages = [
        OpenChannel("ingress:1"), AddRequest(_request("a")), AbortRequest("a"), FinishSequence("a", 2),
        OutputFrame({"a": [ADMITTED, RequestOutput("a", 0, [7], None)], "b": [EngineFailure("queue_full", "full")]},
                    KVCacheEvents(stored=[1])),
    ]

    async def run() -> list[Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(encode(m) for m in messages))
        reader.feed_eof()
        return [await read_message(reader) for _ in messages]

    got = asyncio.run(run())
    assert got == messages and [type(m) for m in got] == [type(m) for m in messages]
    assert isinstance(got[4].batch["a"][0], Admitted)


class _FakeCore:
    """The EngineCore calls the actor makes on its channels' messages."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.finished: list[tuple[str, int, str]] = []

    def add_request(self, request: EngineRequest) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.added.append(request.req_id)

    def abort_request(self, req_id: str) -> None:
        self.aborted.append(req_id)

    def finish_request(self, req_id: str, index: int = 0, reason: str = "stop") -> None:
        self.finished.append((req_id, index, reason))


class _Metrics:
    def __init__(self) -> None:
        self.rejected: list[str] = []

    def observe_rejected(self, reason: str) -> None:
        self.rejected.append(reason)


def _actor(core: _FakeCore) -> Any:
    """A SchedulerActor (the class Ray wraps, no actor) that is ready, over ``core``; its channel server is real."""
    actor = object.__new__(SchedulerActor.__ray_actor_class__)
    config = CBServeConfig(device="cpu")
    actor.config, actor.replica, actor.state, actor.error, actor.generation = config, "0", "ready", None, 1
    actor.engine, actor.requests, actor.metrics = core, {}, _Metrics()
    actor._wakeup = asyncio.Event()
    actor.outputs = ChannelServer(actor._on_message, actor._channel_closed)
    return actor


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Handle:
    def __init__(self, server: ChannelServer) -> None:
        self.output_address = _Remote(server.start)


def _with_channel(core: _FakeCore, body: Callable[[Any, ChannelReader], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        actor = _actor(core)
        reader = ChannelReader(_Handle(actor.outputs), "ingress-1")
        try:
            return await body(actor, reader)
        finally:
            reader.close()
            actor.outputs.close()

    return asyncio.run(asyncio.wait_for(run(), 30))


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_admission_is_answered_on_the_channel_before_any_output() -> None:
    core = _FakeCore()

    async def body(actor: Any, reader: ChannelReader) -> list[Any]:
        queue = reader.register("a")
        reader.send(AddRequest(_request("a")))  # the channel opens for it
        await _until(lambda: "a" in actor.requests)
        actor._dispatch([RequestOutput("a", 0, [5], None)])  # a step's output right after its admission
        items: list[Any] = []
        while len(items) < 2:
            items += await queue.get()
        return items

    assert _with_channel(core, body) == [ADMITTED, RequestOutput("a", 0, [5], None)]
    assert core.added == ["a"]


def test_a_refused_admission_comes_back_as_the_requests_engine_failure() -> None:
    core = _FakeCore(QueueFullError("waiting queue is full"))

    async def body(actor: Any, reader: ChannelReader) -> tuple[list[Any], dict[str, Any]]:
        queue = reader.register("a")
        reader.send(AddRequest(_request("a")))
        return await queue.get(), actor.requests

    items, in_flight = _with_channel(core, body)
    assert items == [EngineFailure("queue_full", "waiting queue is full")] and in_flight == {}


def test_abort_and_finish_frames_reach_the_engine() -> None:
    core = _FakeCore()

    async def body(actor: Any, reader: ChannelReader) -> tuple[list[Any], list[str]]:
        queue = reader.register("a")
        reader.register("b")
        reader.send(AddRequest(_request("a")))
        reader.send(AddRequest(_request("b")))
        reader.tell(FinishSequence("b", 1))
        reader.tell(AbortRequest("a"))
        items: list[Any] = []
        while len(items) < 2:
            items += await queue.get()
        await _until(lambda: core.finished != [])
        return items, list(core.aborted)

    items, aborted = _with_channel(core, body)
    assert items == [ADMITTED, EngineFailure("aborted", "request aborted")]
    assert core.added == ["a", "b"] and aborted == ["a"] and core.finished == [("b", 1, "stop")]
    assert core.aborted == ["a", "b"]  # the reader went: the engine aborted the request it still read for


def test_tell_opens_no_channel() -> None:
    """An abort or a finish for a channel that is not open is dropped (the engine aborted its requests)."""
    core = _FakeCore()

    async def body(actor: Any, reader: ChannelReader) -> bool:
        reader.tell(AbortRequest("a"))
        await asyncio.sleep(0.05)
        return reader.is_open

    assert _with_channel(core, body) is False and core.aborted == []


@pytest.mark.parametrize("first", [AddRequest(_request("a")), "ingress-1:raw"])
def test_a_frame_before_the_channel_id_is_refused(first: Any) -> None:
    core = _FakeCore()

    async def body(actor: Any, reader: ChannelReader) -> tuple[bytes, list[str]]:
        address = await actor.outputs.start()
        r, w = await asyncio.open_connection(address.host, address.port)
        w.write(address.token + encode(first) + encode(OpenChannel("ingress-1:late")))
        answer = await asyncio.wait_for(r.read(), 10)  # closed unanswered
        w.close()
        return answer, list(actor.outputs.buffers)

    answer, channels = _with_channel(core, body)
    assert answer == b"" and channels == [] and core.added == []
