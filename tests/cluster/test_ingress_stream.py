"""A streamed answer cut short at the HTTP edge (cluster/ingress.py) closes the generators behind it at
once, so the request is aborted in the engine now, not when the garbage collector gets to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from cbserve.cluster.ingress import ClosingStreamingResponse, OpenAIIngress


class _Body:
    """An endless SSE body that records when it was closed."""

    def __init__(self) -> None:
        self.closed = False

    async def lines(self) -> AsyncIterator[str]:
        try:
            while True:
                await asyncio.sleep(0)
                yield "data: {}\n\n"
        finally:
            self.closed = True


class _Metrics:
    def __init__(self) -> None:
        self.flight = 0
        self.observed: list[tuple[str, int]] = []

    def in_flight(self, d: int) -> None:
        self.flight += d

    def observe_http(self, route: str, status: int, seconds: float) -> None:
        self.observed.append((route, status))


class _Ingress:
    """The two stream methods of the ingress class, on a stand-in with only ``metrics`` (no engines, and no
    instance of the Serve-wrapped class, whose finaliser needs a running Serve replica)."""

    _accounted = OpenAIIngress.func_or_class._accounted
    _to_response = staticmethod(OpenAIIngress.func_or_class._to_response)

    def __init__(self) -> None:
        self.metrics = _Metrics()


def _scope(spec: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"spec_version": spec}, "method": "POST", "path": "/v1/completions"}


@pytest.mark.parametrize("spec", ["2.4", "2.3"])
def test_a_client_gone_mid_stream_closes_the_body_before_the_response_returns(spec: str) -> None:
    """ASGI 2.4: ``send`` raises once the client is gone; before 2.4: an ``http.disconnect`` arrives."""
    body = _Body()
    ingress = _Ingress()
    ingress.metrics.in_flight(1)  # as _handle does before it hands a stream over
    response = ingress._to_response(ingress._accounted("/v1/completions", 0.0, body.lines()))
    assert isinstance(response, ClosingStreamingResponse)
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and spec == "2.4":
            raise OSError("connection reset")
        sent.append(message)
        if len(sent) == 3:  # the head and two chunks reached the client, then it leaves
            gone.set()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def serve() -> None:
        if spec == "2.4":
            with pytest.raises(ClientDisconnect):
                await response(_scope(spec), receive, send)
        else:
            await response(_scope(spec), receive, send)
        assert body.closed  # closed by the response itself, not later by the garbage collector

    asyncio.run(serve())
    assert ingress.metrics.flight == 0 and ingress.metrics.observed == [("/v1/completions", 200)]


def test_a_stream_cancelled_while_it_sends_closes_the_body() -> None:
    """Serve cancels the handler when the client goes away; if that lands while a chunk is being sent, the
    body is suspended at its ``yield``, and must still be closed."""
    body = _Body()
    response = ClosingStreamingResponse(body.lines(), media_type="text/event-stream")
    sending = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message.get("body"):
            sending.set()
            await asyncio.sleep(3600)  # blocked in send: cancelled here

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def serve() -> None:
        task = asyncio.create_task(response(_scope("2.4"), receive, send))
        await sending.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert body.closed

    asyncio.run(serve())
