"""The engine client's fakes (tests/cluster/test_engine_client_retry.py, test_pd_failover.py): engines with the
SchedulerActor's shape whose ``output_address`` names a channel server speaking the real wire format
(channel_fakes.py), a front-end request state, and the client built over them without Ray."""

from __future__ import annotations

import asyncio
from typing import Any

from channel_fakes import FakeChannelServer, Inbox

from cbserve.cluster.channel.messages import (
    ADMITTED,
    AbortRequest,
    AddRequest,
    EngineFailure,
    EngineState,
    FinishSequence,
    OutputFrame,
)
from cbserve.cluster.channel.reader import ChannelReader
from cbserve.cluster.ingress.engine_client import EngineClient
from cbserve.cluster.ingress.router import Router
from cbserve.config import CBServeConfig
from cbserve.scheduler.requests.request import EngineRequest, RequestOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams


class Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r1", 0, [token], None, finished=finished, finish_reason="length" if finished else None)


DROP = "drop"
FULL = EngineFailure("queue_full", "waiting queue is full")


class FakeEngine:
    """Tells its ``state`` first, then answers each AddRequest on the channel: refuses it with ``items[0]`` when
    that is an EngineFailure, closes the channel when it is ``DROP`` (the actor died), else admits it and sends each
    later item as one frame for the request, then nothing more (a long generation); with ``later``, AddRequests after
    the first are answered by ``later`` instead. Aborts and finishes are recorded."""

    def __init__(self, items: list[Any], state: str = "ready", later: list[Any] | None = None) -> None:
        self.items, self.later = items, later
        self.state = state
        self.calls = 0
        self.aborted: list[str] = []
        self.finished: list[tuple[str, int]] = []
        self.requests: list[EngineRequest] = []
        self.channel = FakeChannelServer(self._channel)
        self.output_address = Remote(self.channel.address)

    async def _channel(self, channel: str, inbox: Inbox) -> Any:
        yield OutputFrame({}, None, EngineState(self.state, 1))
        while True:
            msg = await inbox.get()
            if isinstance(msg, AbortRequest):
                self.aborted.append(msg.req_id)
            elif isinstance(msg, FinishSequence):
                self.finished.append((msg.req_id, msg.index))
            elif isinstance(msg, AddRequest):
                self.calls += 1
                self.requests.append(msg.request)
                req_id = msg.request.req_id
                if self.calls == 2 and self.later is not None:
                    self.items = self.later
                if self.items[0] == DROP:
                    self.state = "restarting"  # its actor is being restarted: it says so when it comes back
                    return
                if isinstance(self.items[0], EngineFailure):
                    yield {req_id: [self.items[0]]}
                    continue
                yield {req_id: [ADMITTED]}
                for item in self.items[1:]:
                    yield {req_id: item if isinstance(item, list) else [item]}


class State:
    """What the engine client reads of the front end's RequestState (frontend/output.py)."""

    def __init__(self, req_id: str = "r1") -> None:
        self.request = EngineRequest(req_id, [1, 2, 3], SamplingParams(max_tokens=4))
        self.queue: Any = None
        self.replica: int | None = None
        self.cost = self.prefill = 0
        self.finished = False
        self.tokens: list[int] = []

    def seen(self, batch: list[RequestOutput]) -> None:
        self.finished = self.finished or any(o.finished for o in batch)
        self.tokens += [t for o in batch if o.index == 0 for t in o.new_token_ids]

    def streamed(self) -> tuple[list[int], float | None]:
        return self.tokens, None


def client_over(*engines: FakeEngine, request_timeout_s: float | None = None) -> EngineClient:
    client = object.__new__(EngineClient)  # no Ray: the fakes stand in for the SchedulerActors
    client.config = CBServeConfig(request_timeout_s=request_timeout_s, device="cpu")
    client.router = Router(len(engines), block_size=4)
    client.engines, client.requests, client.pd = list(engines), {}, None
    client.readers = [ChannelReader(e, i, "owner", client) for i, e in enumerate(engines)]
    client.health = [{"replica": str(i), "state": "starting"} for i in range(len(engines))]
    client._changed, client._ticker = None, None
    return client


async def started(client: EngineClient) -> None:
    client.start()
    await client.wait_started(10)


async def collect(client: EngineClient, state: State, stop: Any = None) -> list[Any]:
    """The request through ``client``: its batches until it finished (or ``stop(got)`` says so)."""
    client.requests[state.request.req_id] = state  # type: ignore[index]
    try:
        outputs = await client.add(state)  # type: ignore[arg-type]
        got: list[Any] = []
        try:
            async for batch in outputs:
                got.append(batch)
                state.seen(batch)
                if state.finished or (stop is not None and stop(got)):
                    break
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return got
    finally:
        client.requests.pop(state.request.req_id)  # type: ignore[attr-defined]


def run_one(client: EngineClient, setup: Any = None, stop: Any = None, state: State | None = None) -> list[Any]:
    """The outputs the request got (the batches flattened: items that came together are handed over together)."""

    async def run() -> list[Any]:
        await started(client)
        if setup is not None:
            setup(client)
        try:
            return [o for batch in await collect(client, state or State(), stop) for o in batch]
        finally:
            await close(client)

    return asyncio.run(run())


async def close(client: EngineClient) -> None:
    """Close the readers and the fakes' servers inside the test's loop."""
    tasks = [r._task for r in client.readers if r._task is not None]
    for reader in client.readers:
        reader.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    for engine in client.engines:
        await engine.channel.close()


def load_on(client: EngineClient, idx: int = 1, tokens: int = 1000) -> Any:
    return lambda c: c.router.add(idx, tokens)
