"""A streamed answer cut short at the HTTP edge (cluster/ingress/http_edge.py) closes the generators behind it at
once, so the request is aborted in the engine now, not when the garbage collector gets to it; the edge counts
the request in flight until then, and checks the API key first."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from cbserve.cluster.ingress.deployment import _response
from cbserve.cluster.ingress.http_edge import ClosingStreamingResponse, HttpEdge


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
    """What the HTTP edge reads of the ingress: its config's API key and its metrics."""

    def __init__(self, api_key: str | None = None, draining: bool = False) -> None:
        self.metrics = _Metrics()
        self.config = SimpleNamespace(api_key=api_key)
        self.draining = draining
        self.http_in_flight = 0


def _edge_scope(spec: str, ingress: _Ingress, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    """The scope the edge sees inside the app: the app (whose state holds the ingress) and the matched route."""
    app = SimpleNamespace(state=SimpleNamespace(ingress=ingress))
    return {**_scope(spec), "app": app, "route": SimpleNamespace(path="/v1/completions"), "headers": headers or []}


def _scope(spec: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"spec_version": spec}, "method": "POST", "path": "/v1/completions"}


@pytest.mark.parametrize("spec", ["2.4", "2.3"])
def test_a_client_gone_mid_stream_closes_the_body_before_the_response_returns(spec: str) -> None:
    """ASGI 2.4: ``send`` raises once the client is gone; before 2.4: an ``http.disconnect`` arrives."""
    body = _Body()
    ingress = _Ingress()
    response = _response(body.lines())
    assert isinstance(response, ClosingStreamingResponse)
    edge = HttpEdge(response)
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
                await edge(_edge_scope(spec, ingress), receive, send)
        else:
            await edge(_edge_scope(spec, ingress), receive, send)
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


@pytest.mark.parametrize(("path", "header", "status"), [
    ("/v1/completions", b"", 401),
    ("/v1/completions", b"Bearer wrong", 401),
    ("/v1/completions", b"Bearer sekret", 200),
    ("/v1/load_lora_adapter", b"", 401),  # the adapter routes too, as every route
    ("/v1/unload_lora_adapter", b"Bearer wrong", 401),
    ("/v1/load_lora_adapter", b"Bearer sekret", 200),
    ("/health", b"", 200),  # open: load balancers ask it
])  # fmt: skip
def test_the_edge_checks_the_api_key_before_the_route(path: str, header: bytes, status: int) -> None:
    ingress = _Ingress(api_key="sekret")
    reached: list[str] = []

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await _response({"ok": True})(scope, receive, send)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {**_edge_scope("2.4", ingress, [(b"authorization", header)] if header else []), "path": path,
             "route": SimpleNamespace(path=path)}
    asyncio.run(HttpEdge(route)(scope, None, send))
    assert sent[0]["status"] == status and (reached == [path]) is (status == 200)
    if status == 401:
        assert json.loads(sent[1]["body"])["error"]["type"] == "authentication_error"
    assert ingress.metrics.flight == 0 and ingress.metrics.observed == ([] if status == 401 else [(path, 200)])


@pytest.mark.parametrize(("path", "status"), [("/v1/completions", 503), ("/health", 200), ("/stats", 200)])
def test_a_draining_edge_refuses_new_requests_with_retry_after(path: str, status: int) -> None:
    """While the ingress drains, new requests get 503 with Retry-After; /health (whose route answers 503 itself)
    and /stats still reach their routes."""
    ingress = _Ingress(draining=True)

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert ingress.http_in_flight == 1  # counted while it runs: the drain waits for it
        await _response({"ok": True})(scope, receive, send)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {**_edge_scope("2.4", ingress), "path": path, "route": SimpleNamespace(path=path)}
    asyncio.run(HttpEdge(route)(scope, None, send))
    assert sent[0]["status"] == status and ingress.http_in_flight == 0
    if status == 503:
        assert (b"retry-after", b"5") in sent[0]["headers"]
        assert json.loads(sent[1]["body"])["error"]["type"] == "service_unavailable"
