"""The two-way engine channel without Ray: typed messages (cluster/channel/messages.py) round trip through the
framing (cluster/channel/transport.py); the real ChannelServer and ChannelReader with the SchedulerActor's own message
handling over a fake EngineCore: an AddRequest is answered on the channel (``Admitted`` before any output, or
the request's EngineFailure), each output goes back on the channel its request came on, aborts and stop-string
finishes reach the engine, a reader that goes away has its requests aborted (not another channel's), the
replica's state reaches every channel, and a peer that sends anything but its channel id first is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from cbserve.cluster.channel.messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    Admitted,
    EngineFailure,
    EngineState,
    FinishSequence,
    OpenChannel,
    OutputFrame,
)
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.channel.server import ChannelServer
from cbserve.cluster.channel.transport import encode, read_message
from cbserve.cluster.engine.scheduler_actor import SchedulerActor
from cbserve.config import CBServeConfig
from cbserve.scheduler.errors import QueueFullError
from cbserve.scheduler.kv.kv_events import KVCacheEvents
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams


def _request(req_id: str) -> EngineRequest:
    return EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))


def test_typed_messages_round_trip_through_the_framing() -> None:
    messages = [
        OpenChannel("ingress:1"), AddRequest(_request("a")), AbortRequest("a"), FinishSequence("a", 2),
        OutputFrame({"a": [ADMITTED, RequestOutput("a", 0, [7], None)], "b": [EngineFailure("queue_full", "full")]},
                    KVCacheEvents(stored=[1]), EngineState("restarting", 2, "a worker died")),
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
    """The EngineCore calls the actor makes on its channels' messages (``groups``: the requests it holds)."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.groups: dict[str, Any] = {}
        self.added: list[tuple[str, int]] = []
        self.aborted: list[str] = []
        self.finished: list[tuple[str, int, str]] = []

    def add_request(self, request: EngineRequest) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.added.append((request.req_id, request.client))
        self.groups[request.req_id] = SimpleNamespace(req_id=request.req_id, client=request.client)

    def abort_request(self, req_id: str) -> None:
        self.aborted.append(req_id)
        self.groups.pop(req_id, None)

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
    config = CBServeConfig(device="cpu", routing="round_robin")  # no prefix-cache events: the fake has no cache
    actor.config, actor.replica, actor.status = config, "0", EngineState("ready", 1)
    actor.engine, actor.metrics, actor._wakeup = core, _Metrics(), asyncio.Event()
    actor.outputs = ChannelServer(actor._on_message, actor._channel_closed, actor._snapshot)
    return actor


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Handle:
    def __init__(self, server: ChannelServer) -> None:
        self.output_address = _Remote(server.start)


class _Sink:
    """Each request's items, in order, from every frame (and the states)."""

    def __init__(self) -> None:
        self.items: dict[str, list[Any]] = {}
        self.states: list[EngineState] = []

    def frame(self, replica: int, frame: Any) -> None:
        if frame.state is not None:
            self.states.append(frame.state)
        for req_id, items in frame.batch.items():
            self.items.setdefault(req_id, []).extend(items)

    def broken(self, replica: int, why: str) -> None:
        pass


def _with_channels(core: _FakeCore, body: Callable[..., Awaitable[Any]], readers: int = 1) -> Any:
    async def run() -> Any:
        actor = _actor(core)
        sinks = [_Sink() for _ in range(readers)]
        channels = [ChannelReader(_Handle(actor.outputs), 0, f"ingress-{i}", sink) for i, sink in enumerate(sinks)]
        for reader in channels:
            reader.start()
        await _until(lambda: all(r.connected for r in channels) and all(s.states for s in sinks))
        try:
            return await body(actor, *zip(channels, sinks, strict=True))
        finally:
            for reader in channels:
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

    async def body(actor: Any, one: tuple[ChannelReader, _Sink]) -> list[Any]:
        reader, sink = one
        reader.send(AddRequest(_request("a")))
        await _until(lambda: core.added)
        client = core.added[0][1]
        actor._dispatch([RequestOutput("a", 0, [5], None, client=client)])  # a step's output right after admission
        await _until(lambda: len(sink.items.get("a", [])) >= 2)
        return sink.items["a"]

    assert _with_channels(core, body) == [ADMITTED, RequestOutput("a", 0, [5], None, client=1)]
    assert core.added == [("a", 1)]  # the request knows its channel


def test_a_refused_admission_comes_back_as_the_requests_engine_failure() -> None:
    core = _FakeCore(QueueFullError("waiting queue is full"))

    async def body(actor: Any, one: tuple[ChannelReader, _Sink]) -> list[Any]:
        reader, sink = one
        reader.send(AddRequest(_request("a")))
        await _until(lambda: "a" in sink.items)
        return sink.items["a"]

    assert _with_channels(core, body) == [EngineFailure("queue_full", "waiting queue is full")]


def test_outputs_go_back_on_their_requests_channel_and_a_reader_that_goes_is_aborted() -> None:
    core = _FakeCore()

    async def body(actor: Any, one: tuple[ChannelReader, _Sink], two: tuple[ChannelReader, _Sink]) -> Any:
        (r1, s1), (r2, s2) = one, two
        r1.send(AddRequest(_request("a")))
        r2.send(AddRequest(_request("b")))
        r2.send(FinishSequence("b", 1))
        await _until(lambda: len(core.added) == 2 and core.finished)
        clients = dict(core.added)
        actor._dispatch([RequestOutput("a", 0, [5], None, client=clients["a"]),
                         RequestOutput("b", 0, [6], None, client=clients["b"])])  # fmt: skip
        await _until(lambda: len(s1.items["a"]) == 2 and len(s2.items["b"]) == 2)
        r1.send(AbortRequest("x"))  # one it never sent: a no-op in the engine
        r1.close()  # its ingress goes: the engine aborts what it sent, not the other channel's
        await _until(lambda: "a" in core.aborted)
        return s1.items, s2.items, list(core.aborted)

    items1, items2, aborted = _with_channels(core, body, readers=2)
    assert items1 == {"a": [ADMITTED, RequestOutput("a", 0, [5], None, client=1)]}
    assert items2 == {"b": [ADMITTED, RequestOutput("b", 0, [6], None, client=2)]}
    assert core.finished == [("b", 1, "stop")] and aborted == ["x", "a"]


def test_the_replicas_state_reaches_every_channel() -> None:
    core = _FakeCore()

    async def body(actor: Any, one: tuple[ChannelReader, _Sink], two: tuple[ChannelReader, _Sink]) -> Any:
        actor._set_state("restarting", "a worker died")
        await _until(lambda: len(one[1].states) == 2 and len(two[1].states) == 2)
        return one[1].states, two[1].states

    first, second = _with_channels(core, body, readers=2)
    assert first == second == [EngineState("ready", 1), EngineState("restarting", 1, "a worker died")]


@pytest.mark.parametrize("first", [AddRequest(_request("a")), "ingress-1:raw"])
def test_a_frame_before_the_channel_id_is_refused(first: Any) -> None:
    core = _FakeCore()

    async def body(actor: Any, one: tuple[ChannelReader, _Sink]) -> tuple[bytes, list[int]]:
        address = await actor.outputs.start()
        r, w = await asyncio.open_connection(address.host, address.port)
        w.write(address.token + encode(first) + encode(OpenChannel("ingress-1:late")))
        answer = await asyncio.wait_for(r.read(), 10)  # closed unanswered
        w.close()
        return answer, list(actor.outputs.buffers)

    answer, channels = _with_channels(core, body)
    assert answer == b"" and channels == [1] and core.added == []  # only the reader's own channel
